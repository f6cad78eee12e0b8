// The WebUI container's nginx setup, checked with Debian's nginx (Docker cannot run here): the rendered config
// passes `nginx -t`, bad settings are refused, the entry point runs as an unprivileged user, streams are not
// buffered, the API key is added, and an unreachable API is answered with a JSON error the app understands.
import assert from 'node:assert/strict';
import { spawn, spawnSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, test } from 'node:test';
import { DIST_DIR, WEBUI_DIR, freePort, readableCopy, startNginx, waitFor } from './harness.mjs';
import { startMock } from './mock-server.mjs';

const RENDER = path.join(WEBUI_DIR, 'nginx', 'render-config.sh');

const renders = [];
function render(env) {
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'nebula-webui-render-'));
  renders.push(tmp);
  const out = path.join(tmp, 'nginx.conf');
  const r = spawnSync(RENDER, [out], { env: { PATH: process.env.PATH, WEBUI_ROOT: DIST_DIR, WEBUI_TMP: tmp, ...env }, encoding: 'utf8' });
  return { ...r, out, tmp, conf: fs.existsSync(out) ? fs.readFileSync(out, 'utf8') : '' };
}

let mock;
before(async () => {
  mock = await startMock();
});
after(async () => {
  await mock?.close();
  for (const dir of renders) fs.rmSync(dir, { recursive: true, force: true });
});

describe('the WebUI container’s nginx', () => {
  test('the container’s defaults render a config that nginx -t accepts', () => {
    const r = render({ NEBULA_API_URL: 'http://nebula:8090', NGINX_RESOLVER: '127.0.0.11' });
    assert.equal(r.status, 0, r.stderr);
    assert.match(r.conf, /set \$nebula_api "http:\/\/nebula:8090";/);
    assert.match(r.conf, /resolver 127\.0\.0\.11 valid=10s;/);
    assert.match(r.conf, /set \$nebula_authorization "\$http_authorization";/);
    assert.doesNotMatch(r.conf, /\$\{[A-Z_]+\}/, 'a template name was left unrendered');
    // stdout not a socket (node's default pipe is one, where nginx cannot open /dev/stdout; Docker's is a pipe).
    const t = spawnSync('nginx', ['-e', 'stderr', '-t', '-c', r.out], { encoding: 'utf8', stdio: ['ignore', 'ignore', 'pipe'] });
    assert.equal(t.status, 0, t.stderr);
    assert.match(t.stderr, /test is successful/);
    const v6 = render({ NEBULA_API_URL: 'http://[::1]:8090/', NGINX_RESOLVER: 'fd00::53' });
    assert.equal(v6.status, 0, v6.stderr);
    assert.match(v6.conf, /set \$nebula_api "http:\/\/\[::1\]:8090";/);
    assert.match(v6.conf, /resolver \[fd00::53\] valid=10s;/);
  });

  test('bad settings are refused with a message naming them', () => {
    for (const [env, message] of [
      [{ NEBULA_API_URL: 'http://nebula:8090/v1' }, /NEBULA_API_URL must look like http:\/\/host:port/],
      [{ NEBULA_API_URL: 'nebula:8090' }, /NEBULA_API_URL/],
      [{ NEBULA_API_URL: 'http://a";evil' }, /NEBULA_API_URL/],
      [{ WEBUI_PORT: 'eighty' }, /WEBUI_PORT must be a port number/],
      [{ NEBULA_API_KEY: 'a b"c' }, /NEBULA_API_KEY may only hold token characters/],
      [{ WEBUI_ROOT: '/nonexistent' }, /has no index.html/],
    ]) {
      const r = render({ NGINX_RESOLVER: '127.0.0.11', ...env });
      assert.equal(r.status, 2, `${JSON.stringify(env)} was accepted`);
      assert.match(r.stderr, message);
    }
  });

  test('the entry point runs nginx as an unprivileged user; an unreachable API gets a JSON 502', async () => {
    const port = await freePort();
    const closed = await freePort();
    const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'nebula-webui-entry-'));
    fs.chmodSync(tmp, 0o777);
    const { dist, nginxDir } = readableCopy();
    const entrypoint = path.join(nginxDir, 'entrypoint.sh');
    const env = { PATH: process.env.PATH, NEBULA_API_URL: `http://127.0.0.1:${closed}`, WEBUI_PORT: String(port), WEBUI_ROOT: dist, WEBUI_TMP: path.join(tmp, 'run'), WEBUI_ACCESS_LOG: 'off' };
    // As in the image: not root (the Dockerfile's USER 10001); here `nobody` via util-linux's setpriv.
    const asUser = process.getuid?.() === 0 ? ['setpriv', ['--reuid=nobody', '--regid=nogroup', '--clear-groups', entrypoint]] : [entrypoint, []];
    const child = spawn(asUser[0], asUser[1], { env, stdio: ['ignore', 'pipe', 'pipe'] });
    let log = '';
    child.stderr.on('data', (d) => (log += d));
    try {
      const url = `http://127.0.0.1:${port}`;
      await waitFor(`${url}/webui-health`, (r) => r.ok, 10_000).catch((e) => assert.fail(`${e.message}\n${log}`));
      const ps = spawnSync('ps', ['-o', 'user=', '--ppid', String(child.pid), '-p', String(child.pid)], { encoding: 'utf8' });
      if (process.getuid?.() === 0) assert.deepEqual([...new Set(ps.stdout.trim().split(/\s+/))], ['nobody']);
      const page = await fetch(`${url}/chat/some-id`);
      assert.equal(page.status, 200);
      assert.match(await page.text(), /<div id="app">/);
      const down = await fetch(`${url}/health`);
      assert.equal(down.status, 502);
      assert.equal((await down.json()).error.code, 'api_unreachable');
      const missing = await fetch(`${url}/assets/nope.js`);
      assert.equal(missing.status, 404);
    } finally {
      child.kill('SIGQUIT');
      await new Promise((r) => child.once('exit', r));
      fs.rmSync(tmp, { recursive: true, force: true });
    }
  });

  test('answers stream through the proxy as they are generated, not buffered', async () => {
    const web = await startNginx(mock.url, 'nginx-stream');
    try {
      const ac = new AbortController();
      const t0 = Date.now();
      const res = await fetch(`${web.url}/v1/chat/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ messages: [{ role: 'user', content: 'slow please' }], stream: true }),
        signal: ac.signal,
      });
      assert.equal(res.headers.get('content-type'), 'text/event-stream');
      const reader = res.body.getReader();
      let text = '';
      while ((text.match(/^data: /gm) ?? []).length < 5) text += new TextDecoder().decode((await reader.read()).value);
      // The whole answer takes 400 × 40 ms; the first events must arrive long before that.
      assert.ok(Date.now() - t0 < 3000, `first events after ${Date.now() - t0} ms`);
      ac.abort();
    } finally {
      await web.stop();
    }
  });

  test('NEBULA_API_KEY is sent to the API as a bearer token', async () => {
    const port = await freePort();
    const r = render({ NEBULA_API_URL: mock.url, WEBUI_PORT: String(port), NEBULA_API_KEY: 'sk-test.123', WEBUI_ACCESS_LOG: 'off' });
    assert.equal(r.status, 0, r.stderr);
    fs.chmodSync(r.tmp, 0o755);
    const child = spawn('nginx', ['-e', 'stderr', '-c', r.out, '-g', 'daemon off;'], { stdio: 'ignore' });
    try {
      await waitFor(`http://127.0.0.1:${port}/health`);
      assert.equal(mock.state.lastHeaders.authorization, 'Bearer sk-test.123');
    } finally {
      child.kill('SIGQUIT');
      await new Promise((res) => child.once('exit', res));
      fs.rmSync(r.tmp, { recursive: true, force: true });
    }
  });
});
