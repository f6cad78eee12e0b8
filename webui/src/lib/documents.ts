/**
 * Text documents attached to a message: which files are accepted, and how their text enters the prompt.
 * Only text goes in (images have their own path, `images.ts`); binary files and files over the size limit are
 * refused with a message that says why.
 */
import type { Attachment, UserMessage } from './types';

/** Largest file accepted, bytes. At ~4 bytes a token this is ~64k tokens, beyond most profiles' context anyway. */
export const MAX_DOCUMENT_BYTES = 256 * 1024;
/** Most documents on one message. */
export const MAX_DOCUMENTS = 8;

/** Extensions read as text: prose, data and source code. */
export const TEXT_EXTENSIONS = [
  'txt', 'md', 'markdown', 'rst', 'csv', 'tsv', 'json', 'jsonl', 'yaml', 'yml', 'toml', 'ini', 'cfg', 'conf', 'xml',
  'html', 'htm', 'css', 'scss', 'log', 'tex', 'sql', 'sh', 'bash', 'zsh', 'fish', 'ps1', 'bat',
  'rs', 'py', 'js', 'mjs', 'cjs', 'ts', 'tsx', 'jsx', 'svelte', 'vue', 'go', 'java', 'kt', 'kts', 'scala', 'c', 'h',
  'cc', 'cpp', 'cxx', 'hpp', 'hh', 'cs', 'rb', 'php', 'pl', 'pm', 'lua', 'r', 'jl', 'swift', 'm', 'mm', 'dart', 'zig',
  'nim', 'hs', 'ml', 'mli', 'ex', 'exs', 'erl', 'clj', 'el', 'lisp', 'scm', 'proto', 'graphql', 'gql', 'cmake',
  'mk', 'gradle', 'diff', 'patch', 'env', 'gitignore', 'dockerfile', 'makefile', 'cu', 'cuh', 'wgsl', 'glsl',
];

/** The `accept` attribute of the file input. */
export const ACCEPT = TEXT_EXTENSIONS.map((e) => `.${e}`).join(',') + ',text/*';

function extension(name: string): string {
  const base = name.split(/[\\/]/).pop() ?? name;
  const dot = base.lastIndexOf('.');
  return (dot < 0 ? base : base.slice(dot + 1)).toLowerCase();
}

export function formatBytes(n: number): string {
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(n < 10 * 1024 ? 1 : 0)} KB`;
  return `${(n / (1024 * 1024)).toFixed(1)} MB`;
}

/** Why `file` cannot be attached, or `null` when it can (checked before reading it). */
export function refuseBeforeReading(file: { name: string; size: number; type: string }): string | null {
  const ext = extension(file.name);
  const textual = TEXT_EXTENSIONS.includes(ext) || file.type.startsWith('text/');
  if (!textual) {
    return `“${file.name}” is not a text document. Attach plain text, Markdown, CSV or source code (.txt, .md, .csv, .py, .rs, …).`;
  }
  if (file.size > MAX_DOCUMENT_BYTES) {
    return `“${file.name}” is ${formatBytes(file.size)}; documents can be at most ${formatBytes(MAX_DOCUMENT_BYTES)}. Attach a smaller excerpt.`;
  }
  return null;
}

/** Decodes a document's bytes as UTF-8 text, or says why it is not text. */
export function decodeText(name: string, bytes: Uint8Array): { text: string } | { error: string } {
  if (bytes.includes(0)) return { error: `“${name}” looks like a binary file (it contains NUL bytes), not text.` };
  let text: string;
  try {
    text = new TextDecoder('utf-8', { fatal: true }).decode(bytes);
  } catch {
    return { error: `“${name}” is not valid UTF-8 text. Save it as UTF-8 and attach it again.` };
  }
  return { text: text.replace(/^\uFEFF/, '').replace(/\r\n?/g, '\n') };
}

/** Reads and checks a `File` from an input or a drop. */
export async function readDocument(file: File): Promise<Attachment | { error: string }> {
  const refused = refuseBeforeReading(file);
  if (refused) return { error: refused };
  const decoded = decodeText(file.name, new Uint8Array(await file.arrayBuffer()));
  if ('error' in decoded) return decoded;
  return { name: file.name, size: file.size, text: decoded.text };
}

/** A code fence longer than any backtick run inside `text`, so the document cannot close it early. */
function fenceFor(text: string): string {
  let longest = 2;
  for (const m of text.matchAll(/`+/g)) longest = Math.max(longest, m[0].length);
  return '`'.repeat(longest + 1);
}

/** The text a user message sends: its attached documents, each fenced and named, then what the person typed. */
export function promptText(m: Pick<UserMessage, 'content' | 'attachments'>): string {
  const docs = (m.attachments ?? []).map((a) => {
    const fence = fenceFor(a.text);
    const lang = extension(a.name);
    return `Document: ${a.name}\n${fence}${/^[a-z0-9]+$/.test(lang) ? lang : ''}\n${a.text.replace(/\n$/, '')}\n${fence}`;
  });
  return [...docs, m.content].filter((s) => s.length > 0).join('\n\n');
}
