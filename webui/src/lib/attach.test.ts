import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { File as NodeFile } from 'node:buffer';
import { describe, expect, it } from 'vitest';
import { addFiles, imagesUnavailable } from './attach';
import type { Attachment, ImageAttachment } from './types';

const PNG = fs.readFileSync(path.join(path.dirname(fileURLToPath(import.meta.url)), '../../docs/status.png'));
const file = (b: Uint8Array | Buffer | string, name: string, type = '') => new NodeFile([b], name, { type }) as unknown as File;
const decode = async () => ({ width: 3, height: 2 });

describe('attaching files', () => {
  it('allows images only when the model lists the image input', () => {
    expect(imagesUnavailable({ id: 'nebula-demo', inputModalities: ['text'] }, 'ok')).toBe('The loaded model (nebula-demo) reads text only: it cannot take images.');
    expect(imagesUnavailable({ id: 'm' }, 'ok')).toMatch(/reads text only/);
    expect(imagesUnavailable({ id: 'm', inputModalities: ['text', 'image'] }, 'ok')).toBeNull();
    expect(imagesUnavailable({ id: 'm', inputModalities: ['text', 'image'] }, 'connecting')).toMatch(/once the server says/);
    expect(imagesUnavailable(null, 'ok')).toMatch(/once the server says/);
  });

  it('sorts files into documents and images, in order, and says why each refused one was refused', async () => {
    const t = { attachments: [] as Attachment[], images: [] as ImageAttachment[], noImages: null, decode };
    const errors = await addFiles([file('# hi\n', 'a.md'), file(PNG, 'shot.png', 'image/png'), file(PNG, 'again.png'), file('x', 'a.md'), file('GIF8', 'bad.gif')], t);
    expect(t.attachments.map((a) => a.name)).toEqual(['a.md']);
    expect(t.images).toEqual([{ name: 'shot.png', mime: 'image/png', size: PNG.length, width: 3, height: 2, dataUrl: `data:image/png;base64,${PNG.toString('base64')}` }]);
    expect(errors).toEqual(['“again.png” is already attached.', '“a.md” is already attached.', '“bad.gif” is not a PNG, JPEG, WebP or GIF file. Images can be PNG, JPEG, WebP or GIF.']);
  });

  it('refuses every image for a text-only model, and an image the browser cannot decode', async () => {
    const t = { attachments: [] as Attachment[], images: [] as ImageAttachment[], noImages: 'The loaded model (m) reads text only: it cannot take images.', decode };
    expect(await addFiles([file(PNG, 'shot.png')], t)).toEqual(['“shot.png” was not attached. The loaded model (m) reads text only: it cannot take images.']);
    const broken = { ...t, noImages: null, decode: async () => ({ error: 'the browser cannot decode it (a damaged or truncated file?)' }) };
    expect(await addFiles([file(PNG.subarray(0, 40), 'cut.png')], broken)).toEqual(['“cut.png” was not attached: the browser cannot decode it (a damaged or truncated file?).']);
    expect(t.images).toEqual([]);
  });
});
