import { describe, expect, it } from 'vitest';
import { chatToMarkdown, exportFileName } from './exportMarkdown';
import { defaultSettings, type Chat } from './types';

const chat: Chat = {
  id: '1',
  title: 'Greeting test',
  createdAt: 0,
  updatedAt: 0,
  settings: { ...defaultSettings(), accuracyLevel: 2 },
  messages: [
    { role: 'user', content: 'Hello!', at: 1, attachments: [{ name: 'notes.md', size: 12, text: '# Notes\nabc\n' }] },
    { role: 'assistant', content: 'Hello! I am **Nebula**.', reasoning: 'The user greets me.\nGreet back.', at: 2 },
    { role: 'user', content: 'Count', at: 3 },
    { role: 'assistant', content: '1 2 3', reasoning: 'count', interrupted: 'stopped', at: 4 },
  ],
};
const now = new Date('2026-11-29T10:00:00Z');

describe('chatToMarkdown', () => {
  it('writes the conversation with the thinking quoted when asked', () => {
    expect(chatToMarkdown(chat, { thinking: true, model: 'nebula-demo', now })).toBe(
      [
        '# Greeting test',
        '',
        '_Exported from Nebula WebUI on 2026-11-29 10:00 UTC · model `nebula-demo` · thinking on · accuracy level 2_',
        '',
        '## User',
        '',
        'Attached: notes.md (12 B)',
        '',
        'Document: notes.md',
        '```md',
        '# Notes',
        'abc',
        '```',
        '',
        'Hello!',
        '',
        '## Assistant',
        '',
        '> **Thinking**',
        '>',
        '> The user greets me.',
        '> Greet back.',
        '',
        'Hello! I am **Nebula**.',
        '',
        '## User',
        '',
        'Count',
        '',
        '## Assistant',
        '',
        '> **Thinking**',
        '>',
        '> count',
        '',
        '1 2 3',
        '',
        '_(stopped)_',
        '',
      ].join('\n'),
    );
  });

  it('leaves the thinking out otherwise', () => {
    const md = chatToMarkdown(chat, { thinking: false, now });
    expect(md).not.toContain('Thinking');
    expect(md).not.toContain('The user greets me.');
    expect(md).toContain('Hello! I am **Nebula**.');
  });

  it('names the images of a message without their bytes', () => {
    const withImage: Chat = {
      ...chat,
      messages: [{ role: 'user', content: 'What is it?', images: [{ name: 'cat.png', mime: 'image/png', size: 2048, width: 640, height: 480, dataUrl: 'data:image/png;base64,AAAA' }], at: 1 }],
    };
    const md = chatToMarkdown(withImage, { thinking: false, now });
    expect(md).toContain('## User\n\nAttached image: cat.png (640×480, 2.0 KB; not included in this export)\n\nWhat is it?\n');
    expect(md).not.toContain('base64');
  });

  it('names the file after the title', () => {
    expect(exportFileName(chat)).toBe('greeting-test.md');
    expect(exportFileName({ ...chat, title: '¿¿??' })).toBe('chat.md');
  });
});
