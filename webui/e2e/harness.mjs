// What the end-to-end tests run on: a real `nebula serve`, the mock API, nginx rendered from nginx/ in front of
// either, and Debian's Chromium driven by playwright-core. Every process started here is stopped by its pid.
import { spawn } from 'node:child_process';
import fs from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';

export const WEBUI_DIR = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
export const REPO_DIR = path.resolve(WEBUI_DIR, '..');
export const DIST_DIR = path.join(WEBUI_DIR, 'dist');
export const ARTIFACTS = path.join(WEBUI_DIR, 'e2e', 'artifacts');
export const CHROMIUM = process.env.CHROMIUM_BIN ?? '/usr/bin/chromium';
export const NEBULA_BIN = process.env.NEBULA_BIN ?? path.join(REPO_DIR, 'target', 'release', 'nebula');

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

export async function freePort() {
  return new Promise((resolve, reject) => {
    const srv = net.createServer();
    srv.unref();
    srv.on('error', reject);
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address();
      srv.close(() => resolve(port));
    });
  });
}

/** Polls `url` until `ok(response)` or the deadline. */
export async function waitFor(url, ok = (r) => r.ok, timeoutMs = 30_000) {
  const end = Date.now() + timeoutMs;
  let last = 'no answer';
  while (Date.now() < end) {
    try {
      const r = await fetch(url);
      if (ok(r)) return r;
      last = `HTTP ${r.status}`;
    } catch (e) {
      last = e.cause?.code ?? e.message;
    }
    await sleep(100);
  }
  throw new Error(`${url} not ready after ${timeoutMs} ms (${last})`);
}

function spawnLogged(cmd, args, name, env = {}) {
  fs.mkdirSync(ARTIFACTS, { recursive: true });
  const log = fs.openSync(path.join(ARTIFACTS, `${name}.log`), 'a');
  const child = spawn(cmd, args, { stdio: ['ignore', log, log], env: { ...process.env, ...env } });
  fs.closeSync(log);
  return child;
}

async function stopChild(child, signal = 'SIGTERM') {
  if (child.exitCode !== null || child.signalCode !== null) return;
  const exited = new Promise((r) => child.once('exit', r));
  child.kill(signal);
  const done = await Promise.race([exited.then(() => true), sleep(5000).then(() => false)]);
  if (!done) {
    child.kill('SIGKILL');
    await exited;
  }
}

/** A real `nebula serve` (the embedded demo model) on a free port. `stop()` and `start()` again on the same port. */
export async function startNebula({ port } = {}) {
  if (!fs.existsSync(NEBULA_BIN)) {
    throw new Error(`no nebula binary at ${NEBULA_BIN}: run \`cargo build --release -p nebula-service\` or set NEBULA_BIN`);
  }
  const p = port ?? (await freePort());
  const server = { port: p, url: `http://127.0.0.1:${p}`, child: null };
  server.start = async () => {
    server.child = spawnLogged(NEBULA_BIN, ['serve', '--host', '127.0.0.1', '--port', String(p)], 'nebula');
    await waitFor(`${server.url}/health`);
  };
  server.stop = async () => {
    if (server.child) await stopChild(server.child);
  };
  await server.start();
  return server;
}

let publicCopy = null;
/**
 * dist/ and nginx/ where any user can read them. Started as root, nginx's workers (and the entry point test) run as
 * `nobody`, who may not be able to traverse the checkout's folders (a clone under /root, say); elsewhere the
 * originals are used.
 */
export function readableCopy() {
  if (process.getuid?.() !== 0) return { dist: DIST_DIR, nginxDir: path.join(WEBUI_DIR, 'nginx') };
  if (!publicCopy) {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nebula-webui-public-'));
    fs.chmodSync(dir, 0o755);
    fs.cpSync(DIST_DIR, path.join(dir, 'dist'), { recursive: true });
    fs.cpSync(path.join(WEBUI_DIR, 'nginx'), path.join(dir, 'nginx'), { recursive: true });
    for (const f of fs.readdirSync(dir, { recursive: true })) {
      const full = path.join(dir, f);
      fs.chmodSync(full, fs.statSync(full).isDirectory() || f.endsWith('.sh') ? 0o755 : 0o644);
    }
    process.on('exit', () => fs.rmSync(dir, { recursive: true, force: true }));
    publicCopy = { dist: path.join(dir, 'dist'), nginxDir: path.join(dir, 'nginx') };
  }
  return publicCopy;
}

/** nginx with the container's config (nginx/render-config.sh) serving dist/ and proxying to `apiUrl`. */
export async function startNginx(apiUrl, name = 'nginx') {
  if (!fs.existsSync(path.join(DIST_DIR, 'index.html'))) throw new Error(`no build in ${DIST_DIR}: run \`npm run build\``);
  const port = await freePort();
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'nebula-webui-nginx-'));
  // Started as root, nginx's workers run as `nobody` and must reach their temp folders (request bodies over 16 KB).
  fs.chmodSync(tmp, 0o755);
  const conf = path.join(tmp, 'nginx.conf');
  const { dist, nginxDir } = readableCopy();
  const env = { NEBULA_API_URL: apiUrl, WEBUI_PORT: String(port), WEBUI_ROOT: dist, WEBUI_TMP: tmp, WEBUI_ACCESS_LOG: 'off' };
  await new Promise((resolve, reject) => {
    const r = spawnLogged(path.join(nginxDir, 'render-config.sh'), [conf], name, env);
    r.on('exit', (code) => (code === 0 ? resolve() : reject(new Error(`render-config.sh exited ${code}; see e2e/artifacts/${name}.log`))));
  });
  const child = spawnLogged('nginx', ['-e', 'stderr', '-c', conf, '-g', 'daemon off;'], name);
  const url = `http://127.0.0.1:${port}`;
  await waitFor(`${url}/webui-health`);
  return {
    url,
    conf,
    stop: async () => {
      await stopChild(child, 'SIGQUIT');
      fs.rmSync(tmp, { recursive: true, force: true });
    },
  };
}

/** Debian's Chromium, headless, with a new empty profile; background networking off (the machine is offline). */
export async function launchBrowser() {
  const userDataDir = fs.mkdtempSync(path.join(os.tmpdir(), 'nebula-webui-chromium-'));
  const context = await chromium.launchPersistentContext(userDataDir, {
    executablePath: CHROMIUM,
    headless: true,
    viewport: { width: 1280, height: 820 },
    acceptDownloads: true,
    args: [
      '--no-sandbox',
      '--disable-background-networking',
      '--disable-component-update',
      '--disable-sync',
      '--no-first-run',
      '--disable-quic',
      '--disable-gpu',
    ],
  });
  const page = context.pages()[0] ?? (await context.newPage());
  const errors = [];
  page.on('pageerror', (e) => errors.push(e.message));
  page.on('dialog', (d) => {
    errors.push(`dialog: ${d.message()}`);
    void d.dismiss();
  });
  return {
    context,
    page,
    /** Uncaught page errors and dialogs seen so far. */
    errors,
    /** Bodies of the chat requests the page sent, in order. */
    chatRequests: collectChatRequests(page),
    close: async () => {
      await context.close();
      fs.rmSync(userDataDir, { recursive: true, force: true });
    },
  };
}

function collectChatRequests(page) {
  const bodies = [];
  page.on('request', (req) => {
    if (req.method() === 'POST' && req.url().endsWith('/v1/chat/completions')) bodies.push(JSON.parse(req.postData() ?? '{}'));
  });
  return bodies;
}

/** Slows the page's network so that a short answer streams over a few seconds (CDP throttling). */
export async function throttle(page, bytesPerSecond) {
  const cdp = await page.context().newCDPSession(page);
  await cdp.send('Network.enable');
  await cdp.send('Network.emulateNetworkConditions', {
    offline: false,
    latency: 0,
    downloadThroughput: bytesPerSecond ?? -1,
    uploadThroughput: -1,
  });
  return cdp;
}

export async function screenshot(page, name) {
  fs.mkdirSync(ARTIFACTS, { recursive: true });
  const file = path.join(ARTIFACTS, `${name}.png`);
  await page.screenshot({ path: file });
  return file;
}

/**
 * An image file drawn and encoded by the page's own Chromium (canvas `toBlob`): a `width`×`height` fill of `color`
 * as `type` (image/png, image/jpeg or image/webp). Returns its bytes.
 */
export async function canvasImage(page, { width, height, color, type = 'image/png' }) {
  const bytes = await page.evaluate(
    async ({ width, height, color, type }) => {
      const c = document.createElement('canvas');
      c.width = width;
      c.height = height;
      const g = c.getContext('2d');
      g.fillStyle = color;
      g.fillRect(0, 0, width, height);
      const blob = await new Promise((r) => c.toBlob(r, type));
      if (blob.type !== type) throw new Error(`the canvas made ${blob.type}, not ${type}`);
      return [...new Uint8Array(await blob.arrayBuffer())];
    },
    { width, height, color, type },
  );
  return Buffer.from(bytes);
}

/**
 * Puts `bytes` (a PNG) on the system clipboard and pastes it into `selector` with Ctrl+V, as a person pasting a
 * screenshot does. Needs the clipboard permissions granted to the page's origin.
 */
export async function pasteImage(page, selector, bytes) {
  await page.evaluate(async (data) => {
    const blob = new Blob([new Uint8Array(data)], { type: 'image/png' });
    await navigator.clipboard.write([new ClipboardItem({ 'image/png': blob })]);
  }, [...bytes]);
  await page.locator(selector).focus();
  await page.keyboard.press('Control+V');
}

/** Drops `files` ({name, mimeType, buffer}) onto `selector` as a drag and drop from the desktop does. */
export async function dropFiles(page, selector, files) {
  const dataTransfer = await page.evaluateHandle((fs) => {
    const dt = new DataTransfer();
    for (const f of fs) dt.items.add(new File([new Uint8Array(f.bytes)], f.name, { type: f.mimeType }));
    return dt;
  }, files.map((f) => ({ name: f.name, mimeType: f.mimeType, bytes: [...f.buffer] })));
  await page.dispatchEvent(selector, 'dragover', { dataTransfer });
  await page.dispatchEvent(selector, 'drop', { dataTransfer });
}
