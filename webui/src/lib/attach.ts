/**
 * Files given to the composer (file buttons, drop, paste) sorted into documents and images, each checked against
 * its limits. What cannot be attached comes back as one message per file, saying why.
 */
import { acceptsImages, type HealthState, type ModelInfo } from './api';
import { MAX_DOCUMENTS, readDocument } from './documents';
import { decodedSize, looksLikeImage, readImage } from './images';
import type { Attachment, ImageAttachment } from './types';

/** Why images cannot be attached now, or `null` when the loaded model reads them. */
export function imagesUnavailable(model: ModelInfo | null, health: HealthState): string | null {
  if (health !== 'ok' || !model) return 'Images can be attached once the server says which inputs its model reads.';
  if (!acceptsImages(model)) return `The loaded model (${model.id}) reads text only: it cannot take images.`;
  return null;
}

export interface AttachTarget {
  /** Documents already on the message; accepted ones are pushed here. */
  attachments: Attachment[];
  /** Images already on the message; accepted ones are pushed here. */
  images: ImageAttachment[];
  /** From [`imagesUnavailable`]: set, every image is refused with it. */
  noImages: string | null;
  /** Checks that an image decodes and reads its size (the browser's decoder by default). */
  decode?: (url: string) => Promise<{ width: number; height: number } | { error: string }>;
}

/** Adds `files` to `target` in order; returns why each refused file was refused. */
export async function addFiles(files: File[], target: AttachTarget): Promise<string[]> {
  const errors: string[] = [];
  const decode = target.decode ?? decodedSize;
  for (const f of files) {
    if (looksLikeImage(f)) {
      if (target.noImages) {
        errors.push(`“${f.name}” was not attached. ${target.noImages}`);
        continue;
      }
      const r = await readImage(f, target.images.length);
      if ('error' in r) {
        errors.push(r.error);
        continue;
      }
      if (target.images.some((i) => i.dataUrl === r.dataUrl)) {
        errors.push(`“${r.name}” is already attached.`);
        continue;
      }
      const size = await decode(r.dataUrl);
      if ('error' in size) {
        errors.push(`“${r.name}” was not attached: ${size.error}.`);
        continue;
      }
      target.images.push({ ...r, ...size });
      continue;
    }
    if (target.attachments.length >= MAX_DOCUMENTS) {
      errors.push(`At most ${MAX_DOCUMENTS} documents per message; “${f.name}” was not attached.`);
      continue;
    }
    const r = await readDocument(f);
    if ('error' in r) errors.push(r.error);
    else if (target.attachments.some((a) => a.name === r.name)) errors.push(`“${r.name}” is already attached.`);
    else target.attachments.push(r);
  }
  return errors;
}
