/** A chat as a Markdown document, with or without the model's thinking. */
import type { Chat } from './types';
import { formatBytes, promptText } from './documents';

export interface ExportOptions {
  thinking: boolean;
  /** Model id written in the header, when known. */
  model?: string;
  /** Time of the export (tests pass a fixed one). */
  now?: Date;
}

/** Quotes every line of `text` as a Markdown blockquote. */
function quote(text: string): string {
  return text
    .trim()
    .split('\n')
    .map((l) => (l ? `> ${l}` : '>'))
    .join('\n');
}

export function chatToMarkdown(chat: Chat, opts: ExportOptions): string {
  const now = opts.now ?? new Date();
  const out: string[] = [`# ${chat.title.replace(/\n/g, ' ')}`, ''];
  const meta = [`Exported from Nebula WebUI on ${now.toISOString().slice(0, 16).replace('T', ' ')} UTC`];
  if (opts.model) meta.push(`model \`${opts.model}\``);
  meta.push(`thinking ${chat.settings.thinking ? 'on' : 'off'}`, `accuracy level ${chat.settings.accuracyLevel}`);
  out.push(`_${meta.join(' · ')}_`, '');
  if (chat.settings.system.trim()) out.push('## System', '', chat.settings.system.trim(), '');
  for (const m of chat.messages) {
    if (m.role === 'user') {
      out.push('## User', '');
      for (const i of m.images ?? []) {
        const px = i.width && i.height ? `${i.width}×${i.height}, ` : '';
        out.push(`Attached image: ${i.name} (${px}${formatBytes(i.size)}; not included in this export)`, '');
      }
      for (const a of m.attachments ?? []) out.push(`Attached: ${a.name} (${formatBytes(a.size)})`, '');
      // The documents' text is part of what was sent; keep it, fenced as it was sent.
      out.push(promptText(m), '');
    } else {
      out.push('## Assistant', '');
      if (opts.thinking && m.reasoning?.trim()) out.push(quote(`**Thinking**\n\n${m.reasoning.trim()}`), '');
      if (m.content.trim()) out.push(m.content.trim(), '');
      if (m.interrupted === 'stopped') out.push('_(stopped)_', '');
      if (m.interrupted === 'error' && m.error) out.push(`_(error: ${m.error.title})_`, '');
    }
  }
  return out.join('\n').replace(/\n{3,}/g, '\n\n').trimEnd() + '\n';
}

/** A file name for the export, from the chat's title. */
export function exportFileName(chat: Chat): string {
  const slug = chat.title
    .toLowerCase()
    .replace(/[^a-z0-9]+/g, '-')
    .replace(/^-+|-+$/g, '')
    .slice(0, 60);
  return `${slug || 'chat'}.md`;
}
