import { File as NodeFile } from 'node:buffer';
import { describe, expect, it } from 'vitest';
import { MAX_DOCUMENT_BYTES, decodeText, promptText, readDocument, refuseBeforeReading } from './documents';

describe('documents', () => {
  it('accepts text, Markdown, CSV and code, and refuses other files with a reason', () => {
    for (const name of ['a.txt', 'b.md', 'c.csv', 'd.rs', 'E.PY', 'Dockerfile.dockerfile']) {
      expect(refuseBeforeReading({ name, size: 10, type: '' })).toBeNull();
    }
    expect(refuseBeforeReading({ name: 'weird.xyz', size: 10, type: 'text/plain' })).toBeNull();
    expect(refuseBeforeReading({ name: 'photo.png', size: 10, type: 'image/png' })).toMatch(/not a text document/);
    expect(refuseBeforeReading({ name: 'big.txt', size: MAX_DOCUMENT_BYTES + 1, type: 'text/plain' })).toMatch(/is 256 KB; documents can be at most 256 KB/);
  });

  it('refuses binary and non-UTF-8 content, and normalizes line ends and the BOM', () => {
    expect(decodeText('x.txt', new Uint8Array([104, 0, 105]))).toEqual({ error: expect.stringMatching(/binary/) });
    expect(decodeText('x.txt', new Uint8Array([0xff, 0xfe, 0x41]))).toEqual({ error: expect.stringMatching(/UTF-8/) });
    expect(decodeText('x.txt', new TextEncoder().encode('\uFEFFa\r\nb\rc'))).toEqual({ text: 'a\nb\nc' });
  });

  it('reads a File', async () => {
    // jsdom's File has no arrayBuffer(); Node's is the same Web API.
    const file = new NodeFile(['name,age\nAda,36\n'], 'people.csv', { type: 'text/csv' }) as unknown as File;
    const doc = await readDocument(file);
    expect(doc).toEqual({ name: 'people.csv', size: 16, text: 'name,age\nAda,36\n' });
  });

  it('fences each document with a fence longer than any it contains', () => {
    const text = promptText({ content: 'Explain', attachments: [{ name: 'r.md', size: 1, text: 'a\n````\nb\n````' }] });
    expect(text).toBe('Document: r.md\n`````md\na\n````\nb\n````\n`````\n\nExplain');
    expect(promptText({ content: 'only text' })).toBe('only text');
  });
});
