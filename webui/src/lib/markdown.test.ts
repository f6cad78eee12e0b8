import { describe, expect, it } from 'vitest';
import { renderMarkdown } from './markdown';

/** Parses rendered HTML into a detached element the way the page would hold it. */
function dom(html: string): HTMLElement {
  const div = document.createElement('div');
  div.innerHTML = html;
  return div;
}

function assertInert(root: HTMLElement) {
  expect(root.querySelectorAll('script, iframe, object, embed, img, svg, style, form, input, link, meta, base').length).toBe(0);
  for (const el of root.querySelectorAll('*')) {
    for (const attr of el.getAttributeNames()) expect(attr).not.toMatch(/^on/i);
    const href = el.getAttribute('href');
    if (href !== null) expect(href).toMatch(/^(https?:|mailto:|#)/);
    expect(el.getAttribute('src')).toBeNull();
  }
}

describe('renderMarkdown', () => {
  it('shows raw HTML from the model as text, never as elements', () => {
    const root = dom(renderMarkdown('Hi <img src=x onerror="alert(1)"> <script>alert(2)</script> <b onclick="x()">b</b>'));
    assertInert(root);
    expect(root.textContent).toContain('<img src=x onerror="alert(1)">');
    expect(root.textContent).toContain('<script>alert(2)</script>');
  });

  it.each([
    '[x](javascript:alert(1))',
    '[x](JaVaScRiPt:alert(1))',
    '[x](  javascript:alert(1))',
    '[x](vbscript:msgbox(1))',
    '[x](data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==)',
    '<javascript:alert(1)>',
    '![a](x" onerror="alert(1))',
    '![a](https://tracker.example/p.png)',
    '[x](https://a.example/"onmouseover="alert(1))',
    '<svg><script>alert(1)</script></svg>',
    '<details open ontoggle=alert(1)>',
    '```html\n<script>alert(1)</script>\n```',
    '| a |\n|:-:|\n| <img src=x onerror=alert(1)> |',
  ])('keeps %s inert', (src) => {
    assertInert(dom(renderMarkdown(src)));
  });

  it('turns images into plain links, so the model cannot make the browser fetch anything', () => {
    const root = dom(renderMarkdown('![a chart](https://example.com/c.png)'));
    const a = root.querySelector('a');
    expect(a?.getAttribute('href')).toBe('https://example.com/c.png');
    expect(a?.textContent).toBe('image: a chart');
  });

  it('opens safe links in a new tab without an opener', () => {
    const a = dom(renderMarkdown('see https://example.com')).querySelector('a');
    expect(a?.getAttribute('href')).toBe('https://example.com');
    expect(a?.getAttribute('target')).toBe('_blank');
    expect(a?.getAttribute('rel')).toContain('noopener');
  });

  it('highlights fenced code and adds a copy button, keeping the code text intact', () => {
    const code = 'fn main() {\n    println!("<b>hi</b>");\n}';
    const root = dom(renderMarkdown('```rust\n' + code + '\n```'));
    expect(root.querySelector('.code-lang')?.textContent).toBe('rust');
    expect(root.querySelector('button.copy-code')).not.toBeNull();
    expect(root.querySelector('pre code')?.textContent).toBe(code + '\n');
    expect(root.querySelector('pre code .hljs-keyword')?.textContent).toBe('fn');
  });

  it('renders tables with alignment and nothing else in style attributes', () => {
    const root = dom(renderMarkdown('| a | b |\n|:-|-:|\n| 1 | 2 |'));
    expect(root.querySelector('td:last-child')?.getAttribute('style')).toBe('text-align:right');
  });
});
