// End-to-end tests of what a real demo server cannot easily produce, against the mock API (e2e/mock-server.mjs)
// behind the same nginx: a hostile model answer, 429, an error mid-stream, the loading phase, and a server that
// reports a profile, placement and metrics (or none of them).
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { canvasImage, dropFiles, launchBrowser, screenshot, startNginx } from './harness.mjs';
import { CODE_ANSWER, startMock } from './mock-server.mjs';

let mock;
let web;
let browser;
let page;

before(async () => {
  mock = await startMock();
  web = await startNginx(mock.url, 'nginx-mock');
  browser = await launchBrowser();
  page = browser.page;
  await browser.context.grantPermissions(['clipboard-read', 'clipboard-write'], { origin: web.url });
  await page.goto(web.url);
  await page.getByTestId('health-label').filter({ hasText: 'Ready' }).waitFor();
});

after(async () => {
  await browser?.close();
  await web?.stop();
  await mock?.close();
});

const lastAnswer = () => page.locator('article.assistant').last();

async function send(text) {
  await page.locator('#composer-input').fill(text);
  await page.locator('#composer-input').press('Enter');
}

async function newChat() {
  await page.getByRole('button', { name: 'New chat', exact: true }).click();
  await page.getByText('What can Nebula do for you?').waitFor();
}

/** Nothing the model wrote became markup that can run, load or navigate. */
async function assertInert() {
  assert.equal(await page.evaluate(() => window.__pwned), undefined, 'a hostile script ran');
  const found = await page.locator('[data-testid="messages"]').evaluate((root) => ({
    active: root.querySelectorAll('script, iframe, img, svg:not(.icon), object, embed, form').length,
    handlers: [...root.querySelectorAll('*')].flatMap((el) => el.getAttributeNames().filter((a) => a.startsWith('on'))),
    badLinks: [...root.querySelectorAll('[href]')].map((a) => a.getAttribute('href')).filter((h) => !/^(https?:|mailto:|#)/.test(h)),
  }));
  assert.deepEqual(found, { active: 0, handlers: [], badLinks: [] });
  assert.deepEqual(browser.errors, []);
}

describe('the WebUI against the mock API', () => {
  test('a model answer made of hostile HTML is shown as text and nothing in it runs', async () => {
    await newChat();
    await send('hostile <img src=x onerror="window.__pwned=99"> please');
    await lastAnswer().getByTestId('stats').waitFor();
    await lastAnswer().locator('details.reasoning summary').click();
    await page.waitForTimeout(300);
    await assertInert();
    const answer = await lastAnswer().getByTestId('answer').textContent();
    assert.ok(answer.includes('<img src=x onerror="window.__pwned=(window.__pwned||0)+1">'), answer);
    assert.ok(answer.includes('<script>window.__pwned=(window.__pwned||0)+10</script>'), answer);
    assert.match(await lastAnswer().getByTestId('reasoning').textContent(), /<script>window.__pwned=42<\/script>/);
    assert.match(await page.locator('.chat-list li.active .title').textContent(), /hostile <img src=x/);
    await screenshot(page, 'mock-hostile');
    // Rendered again from IndexedDB after a reload: still inert.
    await page.reload();
    await lastAnswer().getByTestId('answer').waitFor();
    await page.waitForTimeout(300);
    await assertInert();
    // And the page forbids inline scripts in any case.
    const res = await fetch(web.url);
    assert.match(res.headers.get('content-security-policy'), /script-src 'self'/);
  });

  test('code is highlighted and its copy button copies it', async () => {
    await newChat();
    await send('Show me code');
    await lastAnswer().getByTestId('stats').waitFor();
    const block = lastAnswer().locator('.code-block');
    assert.equal(await block.locator('.code-lang').textContent(), 'rust');
    assert.ok((await block.locator('.hljs-keyword').count()) > 0);
    await block.getByRole('button', { name: 'Copy code' }).click();
    await block.getByText('Copied').waitFor();
    const code = CODE_ANSWER.split('```rust\n')[1].split('```')[0];
    assert.equal(await page.evaluate(() => navigator.clipboard.readText()), code);
    assert.equal(await lastAnswer().locator('table td').nth(1).textContent(), '54');
  });

  test('images dropped or chosen are held to the limits, answered, and kept with the chat', async () => {
    await newChat();
    const png = (color) => canvasImage(page, { width: 8, height: 8, color });
    const first = await png('#f00');
    await dropFiles(page, '.composer', [
      { name: 'dropped.png', mimeType: 'image/png', buffer: first },
      { name: 'notes.md', mimeType: 'text/markdown', buffer: Buffer.from('# Notes\n') },
    ]);
    const thumbs = page.getByRole('list', { name: 'Images to send' });
    await thumbs.locator('img').first().waitFor();
    await page.getByRole('list', { name: 'Documents to send' }).getByText('notes.md').waitFor();
    const more = await Promise.all(['#0f0', '#00f', '#ff0', '#0ff'].map(png));
    await page.locator('#image-input').setInputFiles(more.map((buffer, i) => ({ name: `more${i}.png`, mimeType: 'image/png', buffer })));
    assert.match(await page.getByTestId('upload-error').textContent(), /At most 4 images per message; “more3.png” was not attached/);
    assert.equal(await thumbs.locator('img').count(), 4);
    await thumbs.getByRole('button', { name: 'Remove more2.png' }).click();
    const big = Buffer.concat([first, Buffer.alloc(5 * 1024 * 1024)]);
    const fake = Buffer.from('GIF8 not really');
    await page.locator('#image-input').setInputFiles([
      { name: 'big.png', mimeType: 'image/png', buffer: big },
      { name: 'fake.gif', mimeType: 'image/gif', buffer: fake },
      { name: 'dropped-again.png', mimeType: 'image/png', buffer: first },
    ]);
    // The errors of this choice replace those of the last one once every file is read.
    const errors = await page.getByTestId('upload-error').filter({ hasText: 'big.png' }).textContent();
    assert.match(errors, /“big.png” is 5.0 MB; images can be at most 5.0 MB/);
    assert.match(errors, /“fake.gif” is not a PNG, JPEG, WebP or GIF file/);
    assert.match(errors, /“dropped-again.png” is already attached/);
    assert.match(await page.getByRole('button', { name: 'Attach images' }).getAttribute('title'), /up to 4 per message, 5.0 MB each/);
    await send('Describe them');
    await lastAnswer().getByTestId('stats').waitFor();
    assert.equal((await lastAnswer().getByTestId('answer').textContent()).trim(), 'You said: Describe them [3 images]');
    const sent = mock.requests.at(-1).messages.at(-1).content;
    assert.deepEqual(sent.map((p) => p.type), ['image_url', 'image_url', 'image_url', 'text']);
    assert.equal(sent[0].image_url.url, `data:image/png;base64,${first.toString('base64')}`);
    assert.match(sent[3].text, /^Document: notes.md\n[\s\S]*Describe them$/);
    await page.reload();
    await page.locator('article.user').last().getByRole('list', { name: 'Attached images' }).locator('img').nth(2).waitFor();
    await screenshot(page, 'mock-images');
    assert.deepEqual(browser.errors, []);
  });

  test('429 says the server is busy and when to try again', async () => {
    await newChat();
    await send('are you busy?');
    const err = lastAnswer().getByTestId('message-error');
    await err.waitFor();
    assert.match(await err.textContent(), /Nebula is busy.*HTTP 429.*Try again in 3 s/s);
    await err.getByRole('button', { name: 'Try again' }).waitFor();
    await screenshot(page, 'mock-busy');
  });

  test('an error in the middle of the stream keeps the partial answer and says what failed', async () => {
    await newChat();
    await send('midstream failure');
    const err = lastAnswer().getByTestId('message-error');
    await err.waitFor();
    assert.match(await err.textContent(), /The server failed.*generation failed: the engine stopped/s);
    assert.equal((await lastAnswer().getByTestId('answer').textContent()).trim(), 'You said:');
  });

  test('while the model loads, the phase and progress show and sending waits', async () => {
    mock.state.health = 'loading';
    await page.reload();
    const banner = page.getByTestId('health-banner');
    await banner.filter({ hasText: 'The model is loading: reading weights.' }).waitFor();
    assert.match(await banner.textContent(), /40 %/);
    await page.locator('#composer-input').fill('Hello');
    assert.equal(await page.getByRole('button', { name: 'Send', exact: true }).isDisabled(), true);
    assert.match(await page.locator('#composer-input').getAttribute('placeholder'), /loading/);
    await screenshot(page, 'mock-loading');
    mock.state.health = 'ok';
    await page.getByTestId('health-label').filter({ hasText: 'Ready' }).waitFor({ timeout: 10_000 });
    assert.equal(await banner.count(), 0);
    assert.equal(await page.getByRole('button', { name: 'Send', exact: true }).isDisabled(), false);
  });

  test('the selectors are bounded by the profile, and the status page shows profile, placement and metrics', async () => {
    const ctx = await page.locator('#context-select option').evaluateAll((os) => os.map((o) => o.textContent));
    assert.equal(ctx[0], 'max (96k)');
    const prefill = await page.locator('#prefill-select option').evaluateAll((os) => os.map((o) => o.value));
    assert.deepEqual(prefill, ['', '256', '512', '1024', '2048', '4096']);
    await page.getByRole('link', { name: 'Status' }).click();
    const profile = page.getByTestId('profile');
    await profile.waitFor();
    assert.match(await profile.textContent(), /24gb-vram-64gb-ram.*98,304 tokens.*8,182 tokens/s);
    const rows = await page.getByTestId('placement').locator('tbody tr').allTextContents();
    assert.deepEqual(rows.map((r) => r.replace(/\s+/g, ' ').trim()), ['GPU54', 'RAM348gpu copies: 54', 'SSD110']);
    const metrics = page.getByTestId('metrics');
    await metrics.waitFor();
    assert.equal(await metrics.locator('[data-metric="prefix"] .v').textContent(), '75.0 %');
    assert.equal(await metrics.locator('[data-metric="ttft"] .v').textContent(), '125 ms');
    await page.getByText('nebula:expert_hits_total').first().waitFor();
    await screenshot(page, 'mock-status');
    await page.getByRole('link', { name: 'Chat' }).click();
  });

  test('a server that reports no profile or metrics gets “not reported by this server”', async () => {
    const bare = await startMock({ profile: null, metrics: false });
    const bareWeb = await startNginx(bare.url, 'nginx-bare');
    try {
      const p = await browser.context.newPage();
      await p.goto(`${bareWeb.url}/#/status`);
      await p.getByTestId('metrics-absent').waitFor();
      assert.match(await p.getByTestId('profile-absent').textContent(), /not reported by this server/);
      assert.match(await p.getByTestId('status-page').textContent(), /Placement per tier: not reported by this server/);
      await p.getByRole('link', { name: 'Chat' }).click();
      assert.equal(await p.locator('#prefill-select').isDisabled(), true);
      assert.equal(await p.locator('#prefill-select').getAttribute('title'), 'The server does not report a prefill limit');
      await p.close();
    } finally {
      await bareWeb.stop();
      await bare.close();
    }
  });

  test('an answer cut by a reload keeps what came and is marked stopped', async () => {
    await newChat();
    await send('slow counting please');
    await lastAnswer().getByTestId('answer').filter({ hasText: /\b12\b/ }).waitFor();
    await page.waitForTimeout(2200); // the stream is saved every 2 s
    await page.reload();
    await lastAnswer().getByTestId('stopped-note').waitFor();
    assert.match(await lastAnswer().getByTestId('answer').textContent(), /^1 2 3 4 5 6 7 8 9 10 11 12/);
    await page.getByRole('button', { name: 'Send', exact: true }).waitFor();
  });

  test('dark theme, keyboard and labels', async () => {
    await page.getByRole('button', { name: /Change theme/ }).click(); // system → light
    await page.getByRole('button', { name: /Change theme/ }).click(); // light → dark
    assert.equal(await page.evaluate(() => document.documentElement.dataset.theme), 'dark');
    await newChat();
    await send('code please');
    await lastAnswer().getByTestId('stats').waitFor();
    await screenshot(page, 'mock-dark');
    // Every form control has an accessible name.
    const unnamed = await page.evaluate(() =>
      [...document.querySelectorAll('input, select, textarea, button')].filter((el) => {
        if (el.closest('[aria-hidden="true"]') || el.id === 'file-input') return false;
        const labelled = el.labels?.length || el.getAttribute('aria-label') || el.getAttribute('aria-labelledby');
        return !labelled && !(el.textContent ?? '').trim();
      }).map((el) => el.outerHTML.slice(0, 80)),
    );
    assert.deepEqual(unnamed, []);
    // Escape stops a streaming answer from the message box.
    await send('slow counting');
    await lastAnswer().getByTestId('answer').waitFor();
    await page.locator('#composer-input').press('Escape');
    await lastAnswer().getByTestId('stopped-note').waitFor();
    await page.getByRole('button', { name: /Change theme/ }).click(); // back to system
  });
});
