import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { File as NodeFile } from 'node:buffer';
import { describe, expect, it } from 'vitest';
import {
  MAX_IMAGE_BYTES,
  MAX_IMAGES,
  MAX_REQUEST_IMAGE_BYTES,
  dataUrl,
  looksLikeImage,
  readImage,
  refuseImageBeforeReading,
  refuseRequestImages,
  sniffImageType,
} from './images';
import type { ImageAttachment, Message } from './types';

// A real PNG (a screenshot Chromium wrote for the README).
const SCREENSHOT = fs.readFileSync(path.join(path.dirname(fileURLToPath(import.meta.url)), '../../docs/answer.png'));
const file = (bytes: Uint8Array | Buffer, name: string, type = '') => new NodeFile([bytes], name, { type }) as unknown as File;
const bytes = (...b: (number | string)[]) =>
  new Uint8Array(b.flatMap((x) => (typeof x === 'string' ? [...x].map((c) => c.charCodeAt(0)) : [x])));

describe('images', () => {
  it('reads the format from the signature, not the name', () => {
    expect(sniffImageType(SCREENSHOT)).toBe('image/png');
    expect(sniffImageType(bytes(0xff, 0xd8, 0xff, 0xe0, 0, 0x10, 'JFIF'))).toBe('image/jpeg');
    expect(sniffImageType(bytes('GIF89a', 1, 0, 1, 0))).toBe('image/gif');
    expect(sniffImageType(bytes('GIF87a', 1, 0, 1, 0))).toBe('image/gif');
    expect(sniffImageType(bytes('RIFF', 0x1a, 0, 0, 0, 'WEBPVP8L'))).toBe('image/webp');
    expect(sniffImageType(bytes('RIFF', 0x1a, 0, 0, 0, 'WAVEfmt '))).toBeNull();
    expect(sniffImageType(bytes(0x89, 'PNG'))).toBeNull(); // truncated signature
    expect(sniffImageType(bytes('BM', 0, 0))).toBeNull(); // BMP
    expect(sniffImageType(new TextEncoder().encode('<svg xmlns="http://www.w3.org/2000/svg"/>'))).toBeNull();
  });

  it('sends images down the image path by type or name', () => {
    expect(looksLikeImage({ name: 'a.PNG', type: '' })).toBe(true);
    expect(looksLikeImage({ name: 'clipboard', type: 'image/png' })).toBe(true);
    expect(looksLikeImage({ name: 'photo.heic', type: '' })).toBe(true);
    expect(looksLikeImage({ name: 'notes.md', type: 'text/markdown' })).toBe(false);
  });

  it('refuses too many, too large and empty files before reading them', () => {
    expect(refuseImageBeforeReading({ name: 'a.png', size: 10 }, 0)).toBeNull();
    expect(refuseImageBeforeReading({ name: 'a.png', size: 10 }, MAX_IMAGES)).toMatch(/At most 4 images per message; “a.png” was not attached/);
    expect(refuseImageBeforeReading({ name: 'big.jpg', size: MAX_IMAGE_BYTES + 1 }, 0)).toMatch(/“big.jpg” is 5.0 MB; images can be at most 5.0 MB/);
    expect(refuseImageBeforeReading({ name: 'e.png', size: 0 }, 0)).toMatch(/empty/);
  });

  it('makes the same base64 data URL as Node', () => {
    expect(dataUrl('image/png', SCREENSHOT)).toBe(`data:image/png;base64,${SCREENSHOT.toString('base64')}`);
    const odd = new Uint8Array(70_001).map((_, i) => (i * 7919) & 0xff); // longer than one slice, not a multiple of 3
    expect(dataUrl('image/gif', odd)).toBe(`data:image/gif;base64,${Buffer.from(odd).toString('base64')}`);
  });

  it('reads a file into an attachment typed by its bytes, and says why others are refused', async () => {
    const img = await readImage(file(SCREENSHOT, 'shot.jpg', 'image/jpeg'), 0);
    expect(img).toEqual({ name: 'shot.jpg', mime: 'image/png', size: SCREENSHOT.length, dataUrl: `data:image/png;base64,${SCREENSHOT.toString('base64')}` });
    expect(await readImage(file(bytes('BM', 0, 0, 0), 'old.bmp'), 0)).toEqual({ error: '“old.bmp” is a .bmp file. Images can be PNG, JPEG, WebP or GIF.' });
    expect(await readImage(file(bytes(0x89, 'PNG'), 'cut.png'), 0)).toEqual({ error: '“cut.png” is not a PNG, JPEG, WebP or GIF file. Images can be PNG, JPEG, WebP or GIF.' });
  });

  it('bounds the image bytes of one request, history included', () => {
    const img = (size: number): ImageAttachment => ({ name: 'x.png', mime: 'image/png', size, dataUrl: 'data:,' });
    const history: Message[] = [{ role: 'user', content: 'see', images: [img(10 * 1024 * 1024)], at: 0 }, { role: 'assistant', content: 'ok', at: 1 }];
    expect(refuseRequestImages(history, [img(6 * 1024 * 1024)])).toBeNull();
    expect(refuseRequestImages(history, [img(6 * 1024 * 1024 + 1)])).toMatch(/already holds 10.0 MB of images; with these it would send 16.0 MB, over the 16.0 MB/);
    expect(refuseRequestImages([], [img(MAX_REQUEST_IMAGE_BYTES + 1)])).toMatch(/^These images are 16.0 MB, over/);
    // Text-only turns are never refused, whatever the history holds.
    expect(refuseRequestImages([...history, ...history], [])).toBeNull();
  });
});
