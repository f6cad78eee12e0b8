/**
 * Incremental parser of server-sent events (the WHATWG EventSource format) for `fetch` response bodies: the chat
 * stream is a POST, which `EventSource` cannot send. Feed it decoded text in chunks of any size; it yields each
 * complete event once its terminating blank line has arrived. Comment lines (`: keep-alive`) are skipped.
 */
export interface SseEvent {
  /** `event:` field; `message` when absent. */
  event: string;
  /** The `data:` lines joined with `\n`. */
  data: string;
  /** `id:` field, when present. */
  id?: string;
}

export class SseParser {
  private buffer = '';
  private data: string[] = [];
  private event = '';
  private id: string | undefined;
  private sawField = false;

  /** Adds text and returns the events it completed. */
  push(text: string): SseEvent[] {
    this.buffer += text;
    const events: SseEvent[] = [];
    for (;;) {
      const m = /\r\n|\r|\n/.exec(this.buffer);
      // A lone `\r` at the very end may be the first half of `\r\n`: wait for the next chunk.
      if (!m || (m[0] === '\r' && m.index === this.buffer.length - 1)) break;
      const line = this.buffer.slice(0, m.index);
      this.buffer = this.buffer.slice(m.index + m[0].length);
      const ev = this.line(line);
      if (ev) events.push(ev);
    }
    return events;
  }

  /** Ends the stream: an event left without its blank line is dispatched (servers that close early). */
  end(): SseEvent[] {
    const events: SseEvent[] = [];
    if (this.buffer.length > 0) {
      const ev = this.line(this.buffer.replace(/\r$/, ''));
      this.buffer = '';
      if (ev) events.push(ev);
    }
    const last = this.line('');
    if (last) events.push(last);
    return events;
  }

  private line(line: string): SseEvent | null {
    if (line === '') {
      // Per the spec an event with an empty data buffer is not dispatched.
      const data = this.data.join('\n');
      const ev: SseEvent | null = this.sawField && data !== '' ? { event: this.event || 'message', data } : null;
      if (ev && this.id !== undefined) ev.id = this.id;
      this.data = [];
      this.event = '';
      this.sawField = false;
      return ev;
    }
    if (line.startsWith(':')) return null;
    const colon = line.indexOf(':');
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? '' : line.slice(colon + 1);
    if (value.startsWith(' ')) value = value.slice(1);
    switch (field) {
      case 'data':
        this.data.push(value);
        this.sawField = true;
        break;
      case 'event':
        this.event = value;
        this.sawField = true;
        break;
      case 'id':
        this.id = value;
        break;
      default:
        break; // `retry` and unknown fields do not concern a one-shot POST stream.
    }
    return null;
  }
}
