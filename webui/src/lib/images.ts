/**
 * Images attached to a message: which files are accepted, the limits, and how they are sent (an OpenAI chat
 * `image_url` content part whose URL is a `data:` URL of the file's own bytes; nothing is re-encoded or resized
 * here, the server fits the image to the vision tower's patch grid).
 *
 * The type is read from the file's first bytes (its signature), not from its name or the browser's guess, so a
 * renamed file is refused here rather than by the server.
 */
import { formatBytes } from './documents';
import type { ImageAttachment, Message } from './types';

/** The formats the server decodes, with the signature each file starts with. */
export const IMAGE_TYPES = ['image/png', 'image/jpeg', 'image/webp', 'image/gif'] as const;

/** Largest image file accepted, bytes. */
export const MAX_IMAGE_BYTES = 5 * 1024 * 1024;
/** Most images on one message. */
export const MAX_IMAGES = 4;
/**
 * Most image bytes one request may carry, the conversation's earlier images included (every turn sends the whole
 * history). As base64 this is 4/3 larger: 16 MiB of files make about 21.3 MiB of request, under the 32 MiB that
 * both the API (`body_limit_bytes`) and the WebUI's nginx (`client_max_body_size`) accept.
 */
export const MAX_REQUEST_IMAGE_BYTES = 16 * 1024 * 1024;

/** The `accept` attribute of the image input. */
export const IMAGE_ACCEPT = IMAGE_TYPES.join(',');

/** One line naming the limits, for tooltips and the composer. */
export const IMAGE_LIMITS = `PNG, JPEG, WebP or GIF; up to ${MAX_IMAGES} per message, ${formatBytes(MAX_IMAGE_BYTES)} each`;

const IMAGE_EXTENSIONS = ['png', 'jpg', 'jpeg', 'jpe', 'jfif', 'webp', 'gif', 'bmp', 'tif', 'tiff', 'heic', 'heif', 'avif', 'svg', 'ico'];

function extension(name: string): string {
  const dot = name.lastIndexOf('.');
  return dot < 0 ? '' : name.slice(dot + 1).toLowerCase();
}

/** Whether `file` is meant as an image (by its type or name), so that it goes down the image path, not documents. */
export function looksLikeImage(file: { name: string; type: string }): boolean {
  return file.type.startsWith('image/') || IMAGE_EXTENSIONS.includes(extension(file.name));
}

/**
 * The format of `bytes` from its signature, or `null` when it is none of [`IMAGE_TYPES`]. Signatures: PNG
 * `89 50 4E 47 0D 0A 1A 0A` (the PNG specification's file signature), JPEG: the SOI marker `FF D8` and the next
 * marker's `FF` (ITU-T T.81), GIF: the header `GIF87a` or `GIF89a` (GIF89a specification), WebP: `RIFF`, a 4-byte
 * size, `WEBP` (RFC 9649).
 */
export function sniffImageType(bytes: Uint8Array): (typeof IMAGE_TYPES)[number] | null {
  const ascii = (from: number, to: number) => String.fromCharCode(...bytes.subarray(from, to));
  const png = [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a];
  if (bytes.length >= 8 && png.every((b, i) => bytes[i] === b)) return 'image/png';
  if (bytes.length >= 3 && bytes[0] === 0xff && bytes[1] === 0xd8 && bytes[2] === 0xff) return 'image/jpeg';
  if (bytes.length >= 6 && (ascii(0, 6) === 'GIF87a' || ascii(0, 6) === 'GIF89a')) return 'image/gif';
  if (bytes.length >= 12 && ascii(0, 4) === 'RIFF' && ascii(8, 12) === 'WEBP') return 'image/webp';
  return null;
}

/** Why `file` cannot be attached as an image next to `count` images already on the message, or `null`. */
export function refuseImageBeforeReading(file: { name: string; size: number }, count: number): string | null {
  if (count >= MAX_IMAGES) return `At most ${MAX_IMAGES} images per message; “${file.name}” was not attached.`;
  if (file.size > MAX_IMAGE_BYTES) {
    return `“${file.name}” is ${formatBytes(file.size)}; images can be at most ${formatBytes(MAX_IMAGE_BYTES)}. Attach a smaller or more compressed copy.`;
  }
  if (file.size === 0) return `“${file.name}” is empty.`;
  return null;
}

/** `data:<mime>;base64,…` of `bytes`. */
export function dataUrl(mime: string, bytes: Uint8Array): string {
  let binary = '';
  // In slices: String.fromCharCode takes its bytes as call arguments, and those have a limit.
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return `data:${mime};base64,${btoa(binary)}`;
}

/** Reads and checks an image `File` (size, signature); `count` images are already on the message. */
export async function readImage(file: File, count: number): Promise<ImageAttachment | { error: string }> {
  const refused = refuseImageBeforeReading(file, count);
  if (refused) return { error: refused };
  const bytes = new Uint8Array(await file.arrayBuffer());
  const mime = sniffImageType(bytes);
  if (!mime) {
    const ext = extension(file.name);
    const what = ext && !['png', 'jpg', 'jpeg', 'jpe', 'jfif', 'webp', 'gif'].includes(ext) ? `a .${ext} file` : 'not a PNG, JPEG, WebP or GIF file';
    return { error: `“${file.name}” is ${what}. Images can be PNG, JPEG, WebP or GIF.` };
  }
  return { name: file.name || 'image', mime, size: file.size, dataUrl: dataUrl(mime, bytes) };
}

/**
 * The pixel size of an image as the browser decodes it, or an error when it cannot be decoded (a truncated or
 * corrupt file). Browser only: it needs `Image.decode()`.
 */
export async function decodedSize(url: string): Promise<{ width: number; height: number } | { error: string }> {
  const img = new Image();
  img.src = url;
  try {
    await img.decode();
  } catch {
    return { error: 'the browser cannot decode it (a damaged or truncated file?)' };
  }
  return { width: img.naturalWidth, height: img.naturalHeight };
}

/** Image bytes (original files) in `messages`. */
export function imageBytes(messages: Message[]): number {
  let n = 0;
  for (const m of messages) if (m.role === 'user') for (const i of m.images ?? []) n += i.size;
  return n;
}

/**
 * Why a request holding the images of `history` plus `pending` would be too large, or `null`. The history is what
 * is sent before the new message (for an edit: the messages before the edited one).
 */
export function refuseRequestImages(history: Message[], pending: ImageAttachment[]): string | null {
  const before = imageBytes(history);
  const added = pending.reduce((n, i) => n + i.size, 0);
  if (added === 0 || before + added <= MAX_REQUEST_IMAGE_BYTES) return null;
  const total = formatBytes(before + added);
  const what = before > 0 ? `This chat already holds ${formatBytes(before)} of images; with these it would send ${total}` : `These images are ${total}`;
  return `${what}, over the ${formatBytes(MAX_REQUEST_IMAGE_BYTES)} one request can carry (every turn sends the whole chat). Remove an image or start a new chat.`;
}
