// A stand-in for `nebula serve` with canned answers, for the states a real server cannot easily be put in: a model
// answer made of hostile HTML, 429 busy, an error in the middle of a stream, a loading phase with progress, a
// profile with placement and metrics, a model that reads images. Shapes follow the real server
// (service/src/openai.rs, stream.rs).
//
// In tests: `const mock = await startMock()`; standalone: `node e2e/mock-server.mjs [port]` (default 8090).
import http from 'node:http';

export const HOSTILE_ANSWER = [
  'Here is some HTML: <img src=x onerror="window.__pwned=(window.__pwned||0)+1">',
  '<script>window.__pwned=(window.__pwned||0)+10</script>',
  '<iframe src="javascript:parent.__pwned=100"></iframe>',
  '[click me](javascript:window.__pwned=1000) and ![img](x" onerror="window.__pwned=5)',
  '<a href="#" onclick="window.__pwned=7">link</a> <svg onload="window.__pwned=8"></svg>',
  '',
  '```html',
  '<script>window.__pwned=9</script>',
  '```',
].join('\n');

export const HOSTILE_REASONING = 'Thinking <img src=y onerror="window.__pwned=(window.__pwned||0)+100"> <script>window.__pwned=42</script>';

export const CODE_ANSWER = [
  'Here is **Rust** with a table:',
  '',
  '```rust',
  'fn main() {',
  '    println!("Hello, Nebula!");',
  '}',
  '```',
  '',
  '| tier | experts |',
  '|:-----|--------:|',
  '| GPU  | 54 |',
  '| RAM  | 348 |',
].join('\n');

export const DEFAULT_PROFILE = {
  name: '24gb-vram-64gb-ram',
  vram_gb: 24,
  ram_gb: 64,
  max_context: 98304,
  max_prefill: 8182,
  placement: [
    { tier: 'gpu', experts_per_layer: 54 },
    { tier: 'ram', experts_per_layer: 348, gpu_copies: 54 },
    { tier: 'ssd', experts_per_layer: 110 },
  ],
  ngram_table: 'ssd',
};

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/**
 * Starts the mock on 127.0.0.1. Options: `port` (0: any), `profile` (object or null), `metrics` (bool),
 * `inputModalities` (the card's `input_modalities`; by default the model reads text and images, and answers an
 * image part by counting the images it got).
 * Returns `{ port, url, requests, state, close() }`; `state.health` is `'ok' | 'loading'`, `state.phase`,
 * `state.progress`, `state.lastHeaders` (of the last request); `requests` holds every chat request body received.
 */
export async function startMock({ port = 0, profile = DEFAULT_PROFILE, metrics = true, inputModalities = ['text', 'image'] } = {}) {
  const state = { health: 'ok', phase: 'reading weights', progress: 0.4, generated: 0, running: 0 };
  const requests = [];
  const server = http.createServer(async (req, res) => {
    state.lastHeaders = req.headers;
    const json = (status, body, headers = {}) => {
      res.writeHead(status, { 'content-type': 'application/json', ...headers });
      res.end(JSON.stringify(body));
    };
    const url = new URL(req.url, 'http://x');
    if (req.method === 'GET' && url.pathname === '/health') {
      if (state.health === 'ok') return json(200, { status: 'ok' });
      return json(503, { status: 'loading', phase: state.phase, progress: state.progress });
    }
    if (req.method === 'GET' && url.pathname === '/v1/models') {
      if (state.health !== 'ok') return json(503, { error: { message: 'The model is loading.', type: 'service_unavailable', param: null, code: 'model_loading' } });
      const card = { id: 'nebula-mock', object: 'model', created: 1, owned_by: 'nebula', max_model_len: 98304, input_modalities: inputModalities, output_modalities: ['text'] };
      if (profile) card.profile = profile;
      return json(200, { object: 'list', data: [card] });
    }
    if (req.method === 'GET' && url.pathname === '/metrics') {
      if (!metrics) return json(404, { error: { message: 'Not found', type: 'not_found_error', param: null, code: null } });
      res.writeHead(200, { 'content-type': 'text/plain; version=0.0.4' });
      res.end(
        [
          '# HELP vllm:num_requests_running Requests being generated.',
          '# TYPE vllm:num_requests_running gauge',
          `vllm:num_requests_running{model_name="nebula-mock"} ${state.running}`,
          '# TYPE vllm:num_requests_waiting gauge',
          'vllm:num_requests_waiting{model_name="nebula-mock"} 0',
          '# TYPE vllm:generation_tokens_total counter',
          `vllm:generation_tokens_total{model_name="nebula-mock"} ${state.generated}`,
          '# TYPE vllm:prompt_tokens_total counter',
          'vllm:prompt_tokens_total{model_name="nebula-mock"} 1234',
          '# TYPE vllm:time_to_first_token_seconds histogram',
          'vllm:time_to_first_token_seconds_bucket{le="0.1"} 3',
          'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 4',
          'vllm:time_to_first_token_seconds_sum 0.5',
          'vllm:time_to_first_token_seconds_count 4',
          '# TYPE vllm:prefix_cache_queries_total counter',
          'vllm:prefix_cache_queries_total 200',
          '# TYPE vllm:prefix_cache_hits_total counter',
          'vllm:prefix_cache_hits_total 150',
          '# HELP nebula:expert_hits_total Expert activations served per tier.',
          '# TYPE nebula:expert_hits_total counter',
          'nebula:expert_hits_total{tier="gpu"} 9100',
          'nebula:expert_hits_total{tier="ram"} 2500',
          'nebula:expert_hits_total{tier="ssd"} 400',
          '# TYPE nebula:draft_acceptance_ratio gauge',
          'nebula:draft_acceptance_ratio 0.71',
          '',
        ].join('\n'),
      );
      return;
    }
    if (req.method === 'POST' && url.pathname === '/v1/chat/completions') {
      let raw = '';
      for await (const chunk of req) raw += chunk;
      let body;
      try {
        body = JSON.parse(raw);
      } catch {
        return json(400, { error: { message: 'Malformed JSON.', type: 'invalid_request_error', param: null, code: null } });
      }
      requests.push(body);
      const content = [...body.messages].reverse().find((m) => m.role === 'user')?.content ?? '';
      const parts = Array.isArray(content) ? content : [{ type: 'text', text: content }];
      const images = parts.filter((p) => p.type === 'image_url');
      if (images.length && !inputModalities.includes('image')) {
        return json(400, { error: { message: 'Content part type `image_url` is not supported: this model reads text only.', type: 'invalid_request_error', param: 'messages[0].content[0]', code: null } });
      }
      if (images.some((p) => !/^data:image\/(png|jpeg|webp|gif);base64,[A-Za-z0-9+/]+=*$/.test(p.image_url?.url ?? ''))) {
        return json(400, { error: { message: 'An image_url part needs a base64 data: URL.', type: 'invalid_request_error', param: 'messages', code: null } });
      }
      const text = parts.filter((p) => p.type === 'text').map((p) => p.text).join('\n');
      const last = images.length ? `${text} [${images.length} image${images.length > 1 ? 's' : ''}]` : text;
      if (/\bbusy\b/i.test(last)) {
        return json(429, { error: { message: 'The server is busy: the queue is full.', type: 'rate_limit_error', param: null, code: 'queue_full' } }, { 'retry-after': '3' });
      }
      if (/\btoo long\b/i.test(last)) {
        return json(400, { error: { message: "This model's maximum context length is 98304 tokens, but the prompt has 120000 tokens.", type: 'invalid_request_error', param: 'messages', code: 'context_length_exceeded' } });
      }
      return stream(res, body, last);
    }
    json(404, { error: { message: `No route ${req.method} ${url.pathname}`, type: 'not_found_error', param: null, code: null } });
  });

  async function stream(res, body, last) {
    res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-cache' });
    const thinking = body.chat_template_kwargs?.enable_thinking !== false && body.reasoning_effort !== 'none';
    const base = { id: 'chatcmpl-mock', object: 'chat.completion.chunk', created: 1, model: 'nebula-mock' };
    let closed = false;
    res.on('close', () => (closed = true));
    const send = (delta, finish = null) => {
      if (closed) return;
      res.write(`data: ${JSON.stringify({ ...base, choices: [{ index: 0, delta, finish_reason: finish, logprobs: null }], usage: null })}\n\n`);
    };
    state.running++;
    try {
      send({ role: 'assistant', content: '' });
      let reasoning = '';
      let answer = '';
      let delay = 5;
      if (/hostile/i.test(last)) {
        reasoning = HOSTILE_REASONING;
        answer = HOSTILE_ANSWER;
      } else if (/\bcode\b/i.test(last)) {
        reasoning = 'A small Rust example.';
        answer = CODE_ANSWER;
      } else if (/\bslow\b/i.test(last)) {
        reasoning = 'Counting slowly.';
        answer = Array.from({ length: 400 }, (_, i) => `${i + 1}`).join(' ');
        delay = 40;
      } else {
        reasoning = 'The user said something; answer briefly.';
        answer = `You said: ${last.split('\n').pop()}`;
      }
      const pieces = (s) => s.match(/\S+\s*|\s+/g) ?? [];
      let n = 0;
      if (thinking) for (const p of pieces(reasoning)) { await sleep(delay); send({ reasoning_content: p }); n++; }
      let sent = 0;
      for (const p of pieces(answer)) {
        if (closed) return;
        await sleep(delay);
        send({ content: p });
        n++;
        sent++;
        if (/midstream/i.test(last) && sent === 2) {
          res.write(`data: ${JSON.stringify({ error: { message: 'generation failed: the engine stopped', type: 'server_error', param: null, code: null } })}\n\ndata: [DONE]\n\n`);
          return res.end();
        }
      }
      state.generated += n;
      send({}, 'stop');
      if (body.stream_options?.include_usage) {
        res.write(`data: ${JSON.stringify({ ...base, choices: [], usage: { prompt_tokens: 42, completion_tokens: n, total_tokens: 42 + n } })}\n\n`);
      }
      res.write('data: [DONE]\n\n');
      res.end();
    } finally {
      state.running--;
    }
  }

  await new Promise((r) => server.listen(port, '127.0.0.1', r));
  const actual = server.address().port;
  return {
    port: actual,
    url: `http://127.0.0.1:${actual}`,
    requests,
    state,
    close: () => new Promise((r) => { server.closeAllConnections?.(); server.close(() => r()); }),
  };
}

if (import.meta.url === `file://${process.argv[1]}`) {
  const m = await startMock({ port: Number(process.argv[2] ?? 8090) });
  console.log(`mock Nebula API on ${m.url}`);
}
