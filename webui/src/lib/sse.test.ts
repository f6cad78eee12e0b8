import { describe, expect, it } from 'vitest';
import { SseParser } from './sse';

const STREAM =
  ': keep-alive\n\n' +
  'data: {"a":1}\n\n' +
  'event: note\ndata: line one\ndata: line two\nid: 7\n\n' +
  'data: [DONE]\n\n';

function parseAll(chunks: string[]) {
  const p = new SseParser();
  const out = chunks.flatMap((c) => p.push(c));
  return [...out, ...p.end()];
}

describe('SseParser', () => {
  it('reads events, comments, multi-line data and ids', () => {
    expect(parseAll([STREAM])).toEqual([
      { event: 'message', data: '{"a":1}' },
      { event: 'note', data: 'line one\nline two', id: '7' },
      { event: 'message', data: '[DONE]', id: '7' },
    ]);
  });

  it('gives the same events whatever the chunk boundaries', () => {
    const whole = parseAll([STREAM]);
    for (const size of [1, 2, 3, 5, 7, 13]) {
      const chunks = [];
      for (let i = 0; i < STREAM.length; i += size) chunks.push(STREAM.slice(i, i + size));
      expect(parseAll(chunks)).toEqual(whole);
    }
  });

  it('accepts CRLF and CR line ends, including a CRLF split across chunks', () => {
    const crlf = STREAM.replace(/\n/g, '\r\n');
    expect(parseAll([crlf])).toEqual(parseAll([STREAM]));
    expect(parseAll(crlf.split(/(?<=\r)/))).toEqual(parseAll([STREAM]));
    expect(parseAll([STREAM.replace(/\n/g, '\r')])).toEqual(parseAll([STREAM]));
  });

  it('keeps spaces after the first one and data without a space', () => {
    expect(parseAll(['data:x\n\ndata:  two spaces\n\n'])).toEqual([
      { event: 'message', data: 'x' },
      { event: 'message', data: ' two spaces' },
    ]);
  });

  it('dispatches a last event that lacks its blank line when the stream ends', () => {
    expect(parseAll(['data: {"tail":true}'])).toEqual([{ event: 'message', data: '{"tail":true}' }]);
  });

  it('dispatches nothing for empty data, comments only or an unfinished line kept for the next chunk', () => {
    const p = new SseParser();
    expect(p.push('data:\n\n: comment\n\ndata: par')).toEqual([]);
    expect(p.push('tial\n\n')).toEqual([{ event: 'message', data: 'partial' }]);
  });
});
