import { afterEach, describe, expect, it, vi } from 'vitest';
import { acceptsImages, applyChunk, buildRequest, getHealth, getModel, limits, readProfile, streamChat, type StreamResult } from './api';
import { ApiError, classifyHttpError, friendly } from './errors';
import { defaultSettings, type Message } from './types';

function sse(events: string[], { chunk = 0 } = {}): Response {
  const text = events.map((e) => `data: ${e}\n\n`).join('');
  const enc = new TextEncoder().encode(text);
  const stream = new ReadableStream<Uint8Array>({
    start(c) {
      const size = chunk || enc.length;
      for (let i = 0; i < enc.length; i += size) c.enqueue(enc.slice(i, i + size));
      c.close();
    },
  });
  return new Response(stream, { status: 200, headers: { 'content-type': 'text/event-stream' } });
}

const chunk = (delta: object, finish: string | null = null) =>
  JSON.stringify({ id: 'x', object: 'chat.completion.chunk', choices: [{ index: 0, delta, finish_reason: finish }], usage: null });

afterEach(() => vi.unstubAllGlobals());

describe('applyChunk', () => {
  it('routes reasoning and content, and notes the finish reason, usage and timings', () => {
    const r: StreamResult = { done: false };
    const got: string[] = [];
    const cb = { onReasoning: (t: string) => got.push(`R:${t}`), onContent: (t: string) => got.push(`C:${t}`) };
    applyChunk(JSON.parse(chunk({ role: 'assistant', content: '' })), r, cb, 1);
    expect(r.firstTokenAt).toBeUndefined();
    applyChunk(JSON.parse(chunk({ reasoning_content: 'hm' })), r, cb, 5);
    applyChunk(JSON.parse(chunk({ content: 'Hi' })), r, cb, 9);
    applyChunk(JSON.parse(chunk({}, 'stop')), r, cb, 10);
    applyChunk({ choices: [], usage: { prompt_tokens: 3, completion_tokens: 2 }, timings: { predicted_per_second: 12 } }, r, cb, 11);
    expect(got).toEqual(['R:hm', 'C:Hi']);
    expect(r).toMatchObject({ firstTokenAt: 5, finishReason: 'stop', usage: { prompt_tokens: 3 }, timings: { predicted_per_second: 12 } });
  });

  it('throws the error event sent after the stream began', () => {
    const cb = { onReasoning: () => {}, onContent: () => {} };
    expect(() => applyChunk({ error: { message: 'generation failed: boom', type: 'server_error' } }, { done: false }, cb, 0)).toThrow(
      /generation failed: boom/,
    );
  });
});

describe('streamChat', () => {
  it('streams deltas across arbitrary chunk boundaries until [DONE]', async () => {
    const events = [chunk({ role: 'assistant', content: '' }), chunk({ reasoning_content: 'think ' }), chunk({ content: 'Hello' }), chunk({ content: ' there' }), chunk({}, 'stop'), JSON.stringify({ choices: [], usage: { prompt_tokens: 4, completion_tokens: 3, total_tokens: 7 } }), '[DONE]'];
    const fetchMock = vi.fn(async () => sse(events, { chunk: 7 }));
    vi.stubGlobal('fetch', fetchMock);
    let content = '';
    let reasoning = '';
    const r = await streamChat({ messages: [] }, { onContent: (t) => (content += t), onReasoning: (t) => (reasoning += t) }, new AbortController().signal);
    expect(content).toBe('Hello there');
    expect(reasoning).toBe('think ');
    expect(r.done).toBe(true);
    expect(r.usage?.total_tokens).toBe(7);
    const [url, init] = fetchMock.mock.calls[0] as unknown as [string, RequestInit];
    expect(url).toBe('/v1/chat/completions');
    expect(JSON.parse(init.body as string)).toEqual({ messages: [] });
  });

  it('turns HTTP errors into ApiError kinds with the server message', async () => {
    vi.stubGlobal('fetch', vi.fn(async () => new Response(JSON.stringify({ error: { message: 'queue full', code: 'queue_full' } }), { status: 429, headers: { 'retry-after': '3' } })));
    const err = await streamChat({}, { onContent() {}, onReasoning() {} }, new AbortController().signal).catch((e) => e);
    expect(err).toBeInstanceOf(ApiError);
    expect(err).toMatchObject({ kind: 'busy', retryAfter: 3, message: 'queue full' });
    expect(friendly(err).detail).toMatch(/Try again in 3 s/);
  });

  it('reports an unreachable server and a stream cut short', async () => {
    vi.stubGlobal('fetch', vi.fn(async () => { throw new TypeError('Failed to fetch'); }));
    await expect(streamChat({}, { onContent() {}, onReasoning() {} }, new AbortController().signal)).rejects.toMatchObject({ kind: 'unreachable' });
    vi.stubGlobal('fetch', vi.fn(async () => sse([chunk({ content: 'partial' })])));
    await expect(streamChat({}, { onContent() {}, onReasoning() {} }, new AbortController().signal)).rejects.toMatchObject({ kind: 'server' });
  });

  it('says aborted when the signal fired', async () => {
    const ac = new AbortController();
    vi.stubGlobal('fetch', vi.fn(async (_u: string, init: RequestInit) => {
      ac.abort();
      throw init.signal?.reason ?? new DOMException('aborted', 'AbortError');
    }));
    await expect(streamChat({}, { onContent() {}, onReasoning() {} }, ac.signal)).rejects.toMatchObject({ kind: 'aborted' });
  });
});

describe('classifyHttpError', () => {
  it.each([
    [429, { error: { message: 'busy' } }, 'busy'],
    [400, { error: { message: "This model's maximum context length is 10 tokens", code: 'context_length_exceeded' } }, 'too_long'],
    [413, { error: { message: 'body too large' } }, 'too_long'],
    [503, { status: 'loading' }, 'loading'],
    [502, { error: { message: 'x', code: 'api_unreachable' } }, 'unreachable'],
    [504, '<html>gateway</html>', 'unreachable'],
    [401, { error: { message: 'Invalid API key' } }, 'auth'],
    [404, { error: { message: 'model x does not exist' } }, 'not_found'],
    [400, { error: { message: '`temperature` must be in [0, 2]' } }, 'bad_request'],
    [500, { error: { message: 'oops' } }, 'server'],
  ])('%i → %s', (status, body, kind) => {
    expect(classifyHttpError(status, body, null).kind).toBe(kind);
  });
});

describe('buildRequest', () => {
  const history: Message[] = [
    { role: 'user', content: 'Hi', at: 1 },
    { role: 'assistant', content: 'Hello', reasoning: 'secret thoughts', at: 2 },
    { role: 'assistant', content: '', interrupted: 'error', error: { title: 'x', detail: 'y' }, at: 3 },
    { role: 'user', content: 'Summarize', attachments: [{ name: 'a.txt', size: 3, text: 'abc' }], at: 4 },
  ];

  it('sends thinking, accuracy and usage options, and leaves server defaults out', () => {
    const body = buildRequest('nebula-demo', history, defaultSettings());
    expect(body).toEqual({
      model: 'nebula-demo',
      messages: [
        { role: 'user', content: 'Hi' },
        { role: 'assistant', content: 'Hello' },
        { role: 'user', content: 'Document: a.txt\n```txt\nabc\n```\n\nSummarize' },
      ],
      stream: true,
      stream_options: { include_usage: true },
      accuracy_level: 3,
      chat_template_kwargs: { enable_thinking: true },
    });
  });

  it('turns thinking off, sets effort, sampling, limits and the system prompt when chosen', () => {
    const s = defaultSettings();
    s.thinking = false;
    s.effort = 'low';
    s.accuracyLevel = 1;
    s.sampling = { temperature: 0, top_p: 0.9, top_k: null, min_p: 0.05 };
    s.contextLength = 4096;
    s.prefillLength = 512;
    s.system = ' Be terse. ';
    const body = buildRequest(undefined, history.slice(0, 1), s);
    expect(body).toEqual({
      messages: [{ role: 'system', content: 'Be terse.' }, { role: 'user', content: 'Hi' }],
      stream: true,
      stream_options: { include_usage: true },
      accuracy_level: 1,
      chat_template_kwargs: { enable_thinking: false },
      temperature: 0,
      top_p: 0.9,
      min_p: 0.05,
      max_context: 4096,
      max_prefill: 512,
    });
    s.thinking = true;
    expect(buildRequest(undefined, [], s).reasoning_effort).toBe('low');
  });

  it('sends a message with images as OpenAI content parts: the images, then the text', () => {
    const img = (n: number) => ({ name: `${n}.png`, mime: 'image/png', size: 3, dataUrl: `data:image/png;base64,AAA${n}` });
    const withImages: Message[] = [
      { role: 'user', content: 'What is this?', images: [img(1), img(2)], attachments: [{ name: 'a.txt', size: 3, text: 'abc' }], at: 1 },
      { role: 'assistant', content: 'A cat.', at: 2 },
      { role: 'user', content: '', images: [img(3)], at: 3 },
      { role: 'user', content: 'plain', images: [], at: 4 },
    ];
    expect(buildRequest('m', withImages, defaultSettings()).messages).toEqual([
      {
        role: 'user',
        content: [
          { type: 'image_url', image_url: { url: 'data:image/png;base64,AAA1' } },
          { type: 'image_url', image_url: { url: 'data:image/png;base64,AAA2' } },
          { type: 'text', text: 'Document: a.txt\n```txt\nabc\n```\n\nWhat is this?' },
        ],
      },
      { role: 'assistant', content: 'A cat.' },
      { role: 'user', content: [{ type: 'image_url', image_url: { url: 'data:image/png;base64,AAA3' } }] },
      { role: 'user', content: 'plain' },
    ]);
  });
});

describe('getModel', () => {
  const serve = (card: object) =>
    vi.stubGlobal('fetch', vi.fn(async () => new Response(JSON.stringify({ object: 'list', data: [card] }), { status: 200 })));

  it('reads the input modalities of the model card (Nebula and vLLM at the top, OpenRouter under architecture)', async () => {
    serve({ id: 'nebula-demo', object: 'model', max_model_len: 4096, input_modalities: ['text'], output_modalities: ['text'] });
    const text = await getModel();
    expect(text).toMatchObject({ id: 'nebula-demo', maxModelLen: 4096, inputModalities: ['text'] });
    expect(acceptsImages(text)).toBe(false);
    serve({ id: 'v', input_modalities: ['text', 'image'] });
    expect(acceptsImages(await getModel())).toBe(true);
    serve({ id: 'o', architecture: { input_modalities: ['image', 'text'] } });
    expect(acceptsImages(await getModel())).toBe(true);
    serve({ id: 'none' });
    const none = await getModel();
    expect(none.inputModalities).toBeUndefined();
    expect(acceptsImages(none)).toBe(false);
    expect(acceptsImages(null)).toBe(false);
  });
});

describe('profile and limits', () => {
  it('reads a profile with placement as a list or a map, and bounds the selectors by the smaller limit', () => {
    const p = readProfile({ id: 'm', max_model_len: 32768, profile: { name: 'p24', max_context: 98304, max_prefill: 8182, placement: { ssd: 110, gpu: { experts_per_layer: 54 }, ram: { experts: 348, gpu_copies: 54 } } } });
    expect(p?.placement.map((t) => [t.tier, t.experts])).toEqual([['gpu', 54], ['ram', 348], ['ssd', 110]]);
    expect(p?.placement[1].detail).toBe('gpu copies: 54');
    expect(limits({ id: 'm', maxModelLen: 32768, profile: p })).toEqual({ maxContext: 32768, maxPrefill: 8182 });
    expect(readProfile({ id: 'm' })).toBeUndefined();
    expect(limits({ id: 'm', maxModelLen: 4096 })).toEqual({ maxContext: 4096, maxPrefill: undefined });
    expect(limits(null)).toEqual({ maxContext: undefined, maxPrefill: undefined });
  });
});

describe('getHealth', () => {
  it('tells ready, loading with its phase, and down apart', async () => {
    vi.stubGlobal('fetch', vi.fn(async () => new Response('{"status":"ok"}', { status: 200 })));
    expect(await getHealth()).toEqual({ state: 'ok' });
    vi.stubGlobal('fetch', vi.fn(async () => new Response('{"status":"loading","phase":"reading weights","progress":0.5}', { status: 503 })));
    expect(await getHealth()).toMatchObject({ state: 'loading', phase: 'reading weights', progress: 0.5 });
    vi.stubGlobal('fetch', vi.fn(async () => new Response('{"error":{"message":"not reachable"}}', { status: 502 })));
    expect(await getHealth()).toMatchObject({ state: 'down' });
    vi.stubGlobal('fetch', vi.fn(async () => { throw new TypeError('Failed to fetch'); }));
    expect(await getHealth()).toMatchObject({ state: 'down' });
  });

  it('counts a health check that does not answer in time as down', async () => {
    vi.stubGlobal('fetch', vi.fn((_u: string, init: RequestInit) => new Promise((_r, reject) => {
      init.signal?.addEventListener('abort', () => reject(new DOMException('aborted', 'AbortError')));
    })));
    expect(await getHealth(undefined, 30)).toEqual({ state: 'down', detail: 'no answer within 0.03 s' });
  });
});
