/**
 * Model output to safe HTML. Model text is untrusted: markdown-it runs with `html: false` (raw HTML is shown as
 * text), links are limited to http(s)/mailto, images become links (no request leaves the page on the model's
 * say-so), and DOMPurify cleans the result again with an allow-list before it reaches the DOM. Code blocks are
 * highlighted by highlight.js and get a copy button, wired by event delegation (no inline handlers survive
 * DOMPurify, and none are needed).
 */
import MarkdownIt from 'markdown-it';
import DOMPurify from 'dompurify';
import hljs from 'highlight.js/lib/core';
import bash from 'highlight.js/lib/languages/bash';
import c from 'highlight.js/lib/languages/c';
import cpp from 'highlight.js/lib/languages/cpp';
import csharp from 'highlight.js/lib/languages/csharp';
import css from 'highlight.js/lib/languages/css';
import diff from 'highlight.js/lib/languages/diff';
import dockerfile from 'highlight.js/lib/languages/dockerfile';
import go from 'highlight.js/lib/languages/go';
import ini from 'highlight.js/lib/languages/ini';
import java from 'highlight.js/lib/languages/java';
import javascript from 'highlight.js/lib/languages/javascript';
import json from 'highlight.js/lib/languages/json';
import kotlin from 'highlight.js/lib/languages/kotlin';
import markdown from 'highlight.js/lib/languages/markdown';
import plaintext from 'highlight.js/lib/languages/plaintext';
import python from 'highlight.js/lib/languages/python';
import ruby from 'highlight.js/lib/languages/ruby';
import rust from 'highlight.js/lib/languages/rust';
import shell from 'highlight.js/lib/languages/shell';
import sql from 'highlight.js/lib/languages/sql';
import typescript from 'highlight.js/lib/languages/typescript';
import xml from 'highlight.js/lib/languages/xml';
import yaml from 'highlight.js/lib/languages/yaml';

const languages = {
  bash, c, cpp, csharp, css, diff, dockerfile, go, ini, java, javascript, json, kotlin, markdown, plaintext, python,
  ruby, rust, shell, sql, typescript, xml, yaml,
};
for (const [name, lang] of Object.entries(languages)) hljs.registerLanguage(name, lang);

const md = new MarkdownIt({ html: false, linkify: true, breaks: false, typographer: false });

// Only these schemes may be linked; markdown-it's own check already drops javascript:, vbscript:, file: and data:.
const SAFE_URL = /^(https?:|mailto:|#)/i;
md.validateLink = (url: string) => SAFE_URL.test(url.trim());

function escapeHtml(s: string): string {
  return s.replace(/[&<>"']/g, (ch) => `&${{ '&': 'amp', '<': 'lt', '>': 'gt', '"': 'quot', "'": '#39' }[ch]};`);
}

md.renderer.rules.fence = (tokens, idx) => {
  const token = tokens[idx];
  const info = token.info.trim().split(/\s+/)[0] ?? '';
  const lang = info.toLowerCase();
  const code = token.content;
  let body: string;
  let label = lang;
  if (lang && hljs.getLanguage(lang)) {
    body = hljs.highlight(code, { language: lang, ignoreIllegals: true }).value;
  } else if (!lang && code.length < 20000) {
    const auto = hljs.highlightAuto(code);
    body = auto.value;
    label = auto.language ?? '';
  } else {
    body = escapeHtml(code);
  }
  return (
    `<div class="code-block"><div class="code-head"><span class="code-lang">${escapeHtml(label || 'text')}</span>` +
    `<button type="button" class="copy-code" aria-label="Copy code">Copy</button></div>` +
    `<pre><code class="hljs${label ? ` language-${escapeHtml(label)}` : ''}">${body}</code></pre></div>`
  );
};
md.renderer.rules.code_block = md.renderer.rules.fence;

// An image becomes a plain link with its alt text: the model must not make the browser fetch URLs by itself.
md.renderer.rules.image = (tokens, idx) => {
  const token = tokens[idx];
  const src = String(token.attrGet('src') ?? '');
  const alt = token.children ? md.renderer.renderInlineAsText(token.children, md.options, {}) : token.content;
  const text = escapeHtml(`image: ${alt || src}`);
  return SAFE_URL.test(src) ? `<a href="${escapeHtml(src)}">${text}</a>` : text;
};

const ALLOWED_TAGS = [
  'a', 'b', 'blockquote', 'br', 'button', 'code', 'del', 'div', 'em', 'h1', 'h2', 'h3', 'h4', 'h5', 'h6', 'hr', 'i',
  'li', 'ol', 'p', 'pre', 's', 'span', 'strong', 'sub', 'sup', 'table', 'tbody', 'td', 'th', 'thead', 'tr', 'ul',
];
const ALLOWED_ATTR = ['href', 'title', 'class', 'type', 'aria-label', 'start', 'colspan', 'rowspan', 'align', 'style'];

let hooked = false;
function purifier(): typeof DOMPurify {
  if (!hooked) {
    DOMPurify.addHook('afterSanitizeAttributes', (node) => {
      if (node.tagName === 'A') {
        const href = node.getAttribute('href') ?? '';
        if (!SAFE_URL.test(href)) node.removeAttribute('href');
        else if (!href.startsWith('#')) {
          node.setAttribute('target', '_blank');
          node.setAttribute('rel', 'noopener noreferrer nofollow');
        }
      }
      // markdown-it writes `style="text-align:…"` on table cells; anything else in a style attribute goes.
      if (node.hasAttribute('style')) {
        const style = node.getAttribute('style') ?? '';
        if (/^text-align:\s*(left|right|center)$/.test(style)) node.setAttribute('style', style);
        else node.removeAttribute('style');
      }
    });
    hooked = true;
  }
  return DOMPurify;
}

/** Safe HTML for a Markdown text written by the model (or the user). */
export function renderMarkdown(text: string): string {
  const html = md.render(text);
  return purifier().sanitize(html, {
    ALLOWED_TAGS,
    ALLOWED_ATTR: [...ALLOWED_ATTR, 'target', 'rel'],
    ALLOW_DATA_ATTR: false,
    ALLOW_ARIA_ATTR: false,
  }) as string;
}

/** Copies text, with a fallback for pages served over plain http to another host (no Clipboard API there). */
export async function copyText(text: string): Promise<boolean> {
  try {
    if (navigator.clipboard && window.isSecureContext) {
      await navigator.clipboard.writeText(text);
      return true;
    }
  } catch {
    /* fall through */
  }
  const area = document.createElement('textarea');
  area.value = text;
  area.setAttribute('readonly', '');
  area.style.position = 'fixed';
  area.style.opacity = '0';
  document.body.appendChild(area);
  area.select();
  let ok = false;
  try {
    ok = document.execCommand('copy');
  } finally {
    area.remove();
  }
  return ok;
}
