// End-to-end tests of the WebUI in Debian's Chromium against a real `nebula serve` (the embedded demo model),
// through nginx configured as in the container. The demo model's answers come from scripts/data/demo_chats.json.
import assert from 'node:assert/strict';
import fs from 'node:fs';
import { after, before, describe, test } from 'node:test';
import { launchBrowser, screenshot, startNebula, startNginx, throttle } from './harness.mjs';

const HELLO_ANSWER = 'Hello! I am the Nebula demo model. How can I help?';
const HELLO_THINKING = 'The user greets me. I answer briefly and offer help.';
const MOE_ANSWER = 'A mixture of experts is a layer where a router sends each token to a few of many small feed-forward networks.';

let nebula;
let web;
let browser;
let page;

before(async () => {
  nebula = await startNebula();
  web = await startNginx(nebula.url, 'nginx-real');
  browser = await launchBrowser();
  page = browser.page;
  await page.goto(web.url);
  await page.getByTestId('health-label').filter({ hasText: 'Ready' }).waitFor();
});

after(async () => {
  await browser?.close();
  await web?.stop();
  await nebula?.stop();
});

const lastAnswer = () => page.locator('article.assistant').last();

async function send(text) {
  await page.locator('#composer-input').fill(text);
  await page.locator('#composer-input').press('Enter');
}

async function answered() {
  await lastAnswer().getByTestId('stats').waitFor({ timeout: 30_000 });
  return (await lastAnswer().getByTestId('answer').textContent())?.trim() ?? '';
}

async function newChat() {
  await page.getByRole('button', { name: 'New chat', exact: true }).click();
  await page.getByText('What can Nebula do for you?').waitFor();
}

describe('chatting with a real nebula serve', () => {
  test('a new chat streams the answer after its live reasoning, then shows the stats', async () => {
    await newChat();
    const cdp = await throttle(page, 2500);
    await send('Hello!');
    // The reasoning shows live, in an open block, before the answer begins.
    const thinking = lastAnswer().locator('details.reasoning');
    await thinking.locator('summary', { hasText: 'Thinking…' }).waitFor();
    assert.equal(await thinking.evaluate((d) => d.open), true);
    await page.getByRole('button', { name: 'Stop', exact: true }).waitFor();
    // The answer grows piece by piece.
    const seen = new Set();
    while (!(await lastAnswer().getByTestId('stats').count())) {
      const t = (await lastAnswer().getByTestId('answer').textContent().catch(() => null))?.trim();
      if (t) seen.add(t);
      await page.waitForTimeout(30);
    }
    await cdp.send('Network.emulateNetworkConditions', { offline: false, latency: 0, downloadThroughput: -1, uploadThroughput: -1 });
    assert.equal(await answered(), HELLO_ANSWER);
    const partial = [...seen].filter((t) => t !== HELLO_ANSWER);
    assert.ok(partial.length >= 2 && partial.every((t) => HELLO_ANSWER.startsWith(t)), `partial answers seen: ${JSON.stringify(partial)}`);
    // Once answered, the reasoning is folded and holds the model's thinking.
    assert.equal(await thinking.evaluate((d) => d.open), false);
    assert.equal((await thinking.getByTestId('reasoning').textContent()).trim(), HELLO_THINKING);
    const stats = await lastAnswer().getByTestId('stats').textContent();
    assert.match(stats, /prompt:\s*[1-9]\d* tok/);
    assert.match(stats, /TTFT:\s*[\d.]+ m?s/);
    assert.match(stats, /speed:\s*[\d.]+ tok\/s/);
    assert.match(stats, /context:\s*[1-9][\d,]* \/ [1-9][\d,]*/);
    assert.equal(await page.locator('.chat-list li.active .title').textContent(), 'Hello!');
    await screenshot(page, 'real-answer');
  });

  test('Stop cancels the answer, keeps what came, and the chat goes on', async () => {
    await newChat();
    const cdp = await throttle(page, 600);
    await send('What is a mixture of experts?');
    await lastAnswer().getByTestId('answer').waitFor({ timeout: 30_000 });
    await page.getByRole('button', { name: 'Stop', exact: true }).click();
    await lastAnswer().getByTestId('stopped-note').waitFor();
    await cdp.send('Network.emulateNetworkConditions', { offline: false, latency: 0, downloadThroughput: -1, uploadThroughput: -1 });
    const partial = (await lastAnswer().getByTestId('answer').textContent()).trim();
    assert.ok(partial.length > 0 && partial.length < MOE_ANSWER.length && MOE_ANSWER.startsWith(partial), partial);
    await page.getByRole('button', { name: 'Send', exact: true }).waitFor();
    await send('Hello!');
    assert.equal(await answered(), HELLO_ANSWER);
  });

  test('the thinking switch changes the request, and the reasoning block follows', async () => {
    await newChat();
    await page.getByRole('switch', { name: 'Thinking' }).uncheck();
    await send('Hello!');
    await answered();
    let body = browser.chatRequests.at(-1);
    assert.deepEqual(body.chat_template_kwargs, { enable_thinking: false });
    assert.equal(body.reasoning_effort, undefined);
    assert.equal(await lastAnswer().locator('details.reasoning').count(), 0);

    await page.getByRole('switch', { name: 'Thinking' }).check();
    await page.locator('#effort-select').selectOption('low');
    await send('Hello!');
    await answered();
    body = browser.chatRequests.at(-1);
    assert.deepEqual(body.chat_template_kwargs, { enable_thinking: true });
    assert.equal(body.reasoning_effort, 'low');
    assert.equal(await lastAnswer().locator('details.reasoning').count(), 1);
  });

  test('the chosen accuracy level, sampling and context are sent with each request', async () => {
    await newChat();
    assert.equal(browser.chatRequests.length > 0 && browser.chatRequests.every((b) => b.accuracy_level === 3), true);
    await page.getByRole('radio', { name: /Accuracy level 1/ }).check();
    await page.getByRole('button', { name: 'Sampling' }).click();
    const temp = page.getByRole('group', { name: 'Temperature' });
    await temp.getByRole('checkbox', { name: 'Server default' }).uncheck();
    await page.getByTestId('sampling-temperature').fill('0');
    await page.getByTestId('sampling-temperature').press('Tab');
    await page.getByRole('button', { name: 'Close sampling settings' }).click();
    // Context choices are bounded by the server's limit.
    const limit = (await (await fetch(`${nebula.url}/v1/models`)).json()).data[0].max_model_len;
    const options = await page.locator('#context-select option').evaluateAll((os) => os.map((o) => o.value));
    assert.ok(options.slice(1).every((v) => Number(v) < limit), `${options} within ${limit}`);
    await page.locator('#context-select').selectOption(options[1]);
    await send('What is the capital of France?');
    await answered();
    const body = browser.chatRequests.at(-1);
    assert.equal(body.accuracy_level, 1);
    assert.equal(body.temperature, 0);
    assert.equal(body.top_p, undefined);
    assert.equal(body.max_context, Number(options[1]));
    // The next chat starts from these settings; the level sticks to the chat after a reload.
    await page.reload();
    await page.getByTestId('health-label').filter({ hasText: 'Ready' }).waitFor();
    assert.equal(await page.getByRole('radio', { name: /Accuracy level 1/ }).isChecked(), true);
  });

  test('an uploaded document goes into the prompt; other files are refused with a reason', async () => {
    await newChat();
    const doc = '# Shopping\n\n- apples\n- pears\n';
    await page.locator('#file-input').setInputFiles([
      { name: 'list.md', mimeType: 'text/markdown', buffer: Buffer.from(doc) },
      { name: 'photo.png', mimeType: 'image/png', buffer: Buffer.from([0x89, 0x50, 0x4e, 0x47]) },
    ]);
    await page.getByRole('list', { name: 'Documents to send' }).getByText('list.md').waitFor();
    assert.match(await page.getByTestId('upload-error').textContent(), /“photo.png” is not a text document/);
    await page.locator('#file-input').setInputFiles({ name: 'huge.txt', mimeType: 'text/plain', buffer: Buffer.alloc(300 * 1024, 'a') });
    assert.match(await page.getByTestId('upload-error').textContent(), /“huge.txt” is 300 KB; documents can be at most 256 KB/);
    await send('Summarize the list.');
    await answered();
    const content = browser.chatRequests.at(-1).messages.at(-1).content;
    assert.ok(content.includes(doc.trim()) && content.includes('Document: list.md') && content.endsWith('Summarize the list.'), content);
    await page.locator('article.user').last().getByText('list.md').waitFor();
  });

  test('a prompt over the context limit gets a clear message, not a failure', async () => {
    await newChat();
    const big = 'The quick brown fox jumps over the lazy dog. '.repeat(3000);
    await page.locator('#file-input').setInputFiles({ name: 'big.txt', mimeType: 'text/plain', buffer: Buffer.from(big) });
    await send('Summarize.');
    const err = lastAnswer().getByTestId('message-error');
    await err.waitFor();
    assert.match(await err.textContent(), /The prompt is too long.*maximum context length is \d+ tokens/s);
    await screenshot(page, 'real-too-long');
  });

  test('chats can be renamed, searched and deleted, and survive a reload', async () => {
    const hello = page.locator('.chat-list li', { hasText: 'Hello!' }).first();
    const id = await hello.getAttribute('data-chat-id');
    await hello.getByRole('button', { name: 'Rename Hello!' }).click();
    await page.locator(`#rename-${id}`).fill('Greetings from Nebula');
    await page.locator(`#rename-${id}`).press('Enter');
    await page.locator('.chat-list .title', { hasText: 'Greetings from Nebula' }).waitFor();
    // The list shows the new title at once; the chat item takes the focus back once IndexedDB has committed it
    // (Sidebar's commitRename), and only then is a reload sure to keep it.
    await page.waitForFunction((chatId) => document.activeElement?.id === `chat-${chatId}`, id);
    const before = await page.locator('.chat-list li[data-chat-id]').count();

    await page.reload();
    await page.locator('.chat-list .title', { hasText: 'Greetings from Nebula' }).waitFor();
    // The empty chat left open is not saved; every chat with messages is.
    assert.ok((await page.locator('.chat-list li[data-chat-id]').count()) >= before - 1);
    await page.locator('.chat-list .title', { hasText: 'Greetings from Nebula' }).click();
    assert.equal(await answered(), HELLO_ANSWER);

    await page.getByLabel('Search chats').fill('capital of france');
    assert.deepEqual(await page.locator('.chat-list .title').allTextContents(), ['What is the capital of France?']);
    await page.getByLabel('Search chats').fill('');

    const victim = page.locator('.chat-list li', { hasText: 'Summarize' }).first();
    const victimId = await victim.getAttribute('data-chat-id');
    await victim.getByRole('button', { name: /^Delete / }).click();
    await page.getByRole('group', { name: /Delete .*\?/ }).getByRole('button', { name: 'Delete' }).click();
    await page.locator(`.chat-list li[data-chat-id="${victimId}"]`).waitFor({ state: 'detached' });
    await page.reload();
    await page.locator('.chat-list .title', { hasText: 'Greetings from Nebula' }).waitFor();
    assert.equal(await page.locator(`.chat-list li[data-chat-id="${victimId}"]`).count(), 0);
  });

  test('a chat exports as Markdown with or without the thinking', async () => {
    await page.locator('.chat-list .title', { hasText: 'Greetings from Nebula' }).click();
    const exportAs = async (item) => {
      await page.getByText('Export').click();
      const [download] = await Promise.all([page.waitForEvent('download'), page.getByRole('menuitem', { name: item, exact: true }).click()]);
      assert.equal(download.suggestedFilename(), 'greetings-from-nebula.md');
      return fs.readFileSync(await download.path(), 'utf8');
    };
    const withThinking = await exportAs('Markdown with thinking');
    assert.match(withThinking, /^# Greetings from Nebula\n/);
    assert.match(withThinking, /model `nebula-demo`/);
    assert.ok(withThinking.includes(`## User\n\nHello!\n\n## Assistant\n\n> **Thinking**\n>\n> ${HELLO_THINKING}\n\n${HELLO_ANSWER}\n`), withThinking);
    const plain = await exportAs('Markdown');
    assert.ok(plain.includes(`## User\n\nHello!\n\n## Assistant\n\n${HELLO_ANSWER}\n`), plain);
    assert.ok(!plain.includes('Thinking') && !plain.includes(HELLO_THINKING));
  });

  test('when the server stops, the page says so, and recovers when it is back', async () => {
    await newChat();
    await nebula.stop();
    await page.getByTestId('health-banner').filter({ hasText: 'not reachable' }).waitFor({ timeout: 15_000 });
    await page.locator('#composer-input').fill('Hello!');
    assert.equal(await page.getByRole('button', { name: 'Send', exact: true }).isDisabled(), true);
    await screenshot(page, 'real-server-down');

    await nebula.start();
    await page.getByTestId('health-label').filter({ hasText: 'Ready' }).waitFor({ timeout: 15_000 });
    assert.equal(await page.getByTestId('health-banner').count(), 0);
    await page.locator('#composer-input').press('Enter');
    assert.equal(await answered(), HELLO_ANSWER);

    // Stopped between two health checks (held at "ok" here so that the timing cannot vary): the request itself
    // fails, with the same clear message and a retry.
    await page.route('**/health', (route) => route.fulfill({ status: 200, contentType: 'application/json', body: '{"status":"ok"}' }));
    await nebula.stop();
    await send('What is the capital of Japan?');
    const err = lastAnswer().getByTestId('message-error');
    await err.waitFor();
    assert.match(await err.textContent(), /The Nebula server is not reachable/);
    await page.unroute('**/health');
    await nebula.start();
    await page.getByTestId('health-label').filter({ hasText: 'Ready' }).waitFor({ timeout: 15_000 });
    await lastAnswer().getByRole('button', { name: 'Try again' }).click();
    assert.match(await answered(), /Tokyo/);
    assert.deepEqual(browser.errors, []);
  });
});
