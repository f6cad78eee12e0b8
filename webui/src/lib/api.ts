/**
 * The Nebula HTTP API as the WebUI uses it: `/health`, `/v1/models`, `/metrics` and streamed
 * `/v1/chat/completions`. Everything is same-origin: nginx (or the Vite dev server) proxies these paths.
 */
import { ApiError, classifyHttpError, errorMessage } from './errors';
import { SseParser } from './sse';
import type { ChatSettings, Message, UserMessage } from './types';
import { promptText } from './documents';

/** `connecting`: no health check has answered yet (the page just opened). */
export type HealthState = 'connecting' | 'ok' | 'loading' | 'failed' | 'down';

/** How long one health check may take before the server counts as not reachable, ms. */
export const HEALTH_TIMEOUT_MS = 10_000;

export interface Health {
  state: HealthState;
  /** The loading phase the server reports (e.g. "reading weights"), when it does. */
  phase?: string;
  /** 0..1 when the server reports progress. */
  progress?: number;
  detail?: string;
}

/** One tier of expert placement ("gpu", "ram", "ssd") and how many experts per layer it holds. */
export interface PlacementTier {
  tier: string;
  experts?: number;
  detail?: string;
}

/** What the server says about its hardware profile; every field may be missing on a server that does not say. */
export interface Profile {
  name?: string;
  maxContext?: number;
  maxPrefill?: number;
  placement: PlacementTier[];
  /** Every scalar the server reported, for the status page. */
  raw: [string, string][];
}

export interface ModelInfo {
  id: string;
  maxModelLen?: number;
  profile?: Profile;
  /** What the model reads (`input_modalities` of the model card), when the server says. */
  inputModalities?: string[];
}

/** Whether the loaded model reads images: its card lists the `image` input modality. */
export function acceptsImages(model: ModelInfo | null): boolean {
  return model?.inputModalities?.includes('image') ?? false;
}

/**
 * The input modalities of a model card: `input_modalities` (Nebula, vLLM), or `architecture.input_modalities`
 * (OpenRouter).
 */
function readModalities(card: Record<string, unknown>): string[] | undefined {
  const arch = card.architecture && typeof card.architecture === 'object' ? (card.architecture as Record<string, unknown>) : {};
  const v = card.input_modalities ?? arch.input_modalities;
  return Array.isArray(v) ? v.filter((x): x is string => typeof x === 'string') : undefined;
}

async function readJson(res: Response): Promise<unknown> {
  const text = await res.text();
  try {
    return JSON.parse(text);
  } catch {
    return text;
  }
}

export async function getHealth(signal?: AbortSignal, timeoutMs = HEALTH_TIMEOUT_MS): Promise<Health> {
  const timeout = new AbortController();
  const timer = setTimeout(() => timeout.abort(), timeoutMs);
  const onAbort = () => timeout.abort();
  signal?.addEventListener('abort', onAbort);
  let res: Response;
  let body: unknown;
  try {
    res = await fetch('/health', { signal: timeout.signal, cache: 'no-store' });
    body = await readJson(res);
  } catch (e) {
    if (signal?.aborted) throw e;
    return { state: 'down', detail: timeout.signal.aborted ? `no answer within ${timeoutMs / 1000} s` : 'no answer' };
  } finally {
    clearTimeout(timer);
    signal?.removeEventListener('abort', onAbort);
  }
  const o = body && typeof body === 'object' ? (body as Record<string, unknown>) : {};
  if (res.ok && (o.status === undefined || o.status === 'ok')) return { state: 'ok' };
  if (res.status === 502 || res.status === 504 || (res.status >= 500 && !('status' in o))) {
    return { state: 'down', detail: errorMessage(body, `HTTP ${res.status}`).message };
  }
  const phase = typeof o.phase === 'string' ? o.phase : undefined;
  const progress = typeof o.progress === 'number' && o.progress >= 0 && o.progress <= 1 ? o.progress : undefined;
  const detail = typeof o.message === 'string' ? o.message : typeof o.error === 'string' ? o.error : undefined;
  if (o.status === 'failed') return { state: 'failed', phase, detail };
  return { state: 'loading', phase, progress, detail };
}

function num(v: unknown): number | undefined {
  if (typeof v === 'number' && Number.isFinite(v) && v > 0) return v;
  if (typeof v === 'string' && /^\d+$/.test(v)) return Number(v);
  return undefined;
}

const TIER_ORDER = ['gpu', 'vram', 'ram', 'cpu', 'ssd', 'disk'];

/** Reads placement in the shapes a server may use: a list of `{tier, experts…}` or a map tier → count/object. */
function readPlacement(v: unknown): PlacementTier[] {
  const tiers: PlacementTier[] = [];
  const one = (tier: string, x: unknown) => {
    if (typeof x === 'number') tiers.push({ tier, experts: x });
    else if (x && typeof x === 'object') {
      const o = x as Record<string, unknown>;
      const experts = num(o.experts_per_layer) ?? num(o.experts) ?? num(o.count);
      const rest = Object.entries(o)
        .filter(([k, val]) => !['tier', 'name', 'experts_per_layer', 'experts', 'count'].includes(k) && isScalar(val))
        .map(([k, val]) => `${k.replace(/_/g, ' ')}: ${val}`)
        .join(', ');
      tiers.push({ tier, experts, detail: rest || undefined });
    } else if (typeof x === 'string') tiers.push({ tier, detail: x });
  };
  if (Array.isArray(v)) {
    for (const x of v) {
      if (x && typeof x === 'object') {
        const o = x as Record<string, unknown>;
        one(String(o.tier ?? o.name ?? '?'), o);
      }
    }
  } else if (v && typeof v === 'object') {
    for (const [k, x] of Object.entries(v as Record<string, unknown>)) one(k, x);
  }
  const rank = (t: string) => {
    const i = TIER_ORDER.indexOf(t.toLowerCase());
    return i < 0 ? TIER_ORDER.length : i;
  };
  return tiers.sort((a, b) => rank(a.tier) - rank(b.tier));
}

function isScalar(v: unknown): v is string | number | boolean {
  return typeof v === 'string' || typeof v === 'number' || typeof v === 'boolean';
}

/** Normalizes the `profile` of a model card (see webui/README.md for the shape read). */
export function readProfile(card: Record<string, unknown>): Profile | undefined {
  const p = card.profile;
  if (p === undefined || p === null) {
    const maxPrefill = num(card.max_prefill) ?? num(card.max_prefill_len);
    return maxPrefill ? { maxPrefill, placement: [], raw: [['max prefill', String(maxPrefill)]] } : undefined;
  }
  if (typeof p === 'string') return { name: p, placement: [], raw: [['name', p]] };
  if (typeof p !== 'object') return undefined;
  const o = p as Record<string, unknown>;
  const raw: [string, string][] = [];
  for (const [k, v] of Object.entries(o)) if (isScalar(v)) raw.push([k.replace(/_/g, ' '), String(v)]);
  return {
    name: typeof o.name === 'string' ? o.name : typeof o.id === 'string' ? o.id : undefined,
    maxContext: num(o.max_context) ?? num(o.max_context_len) ?? num(o.context),
    maxPrefill: num(o.max_prefill) ?? num(o.max_prefill_len) ?? num(o.prefill),
    placement: readPlacement(o.placement ?? o.tiers ?? o.experts),
    raw,
  };
}

export async function getModel(signal?: AbortSignal): Promise<ModelInfo> {
  let res: Response;
  try {
    res = await fetch('/v1/models', { signal, cache: 'no-store' });
  } catch (e) {
    if (signal?.aborted) throw e;
    throw new ApiError('unreachable', 'no answer from /v1/models');
  }
  const body = await readJson(res);
  if (!res.ok) throw classifyHttpError(res.status, body, res.headers.get('retry-after'));
  const data = (body as { data?: unknown[] })?.data;
  const card = Array.isArray(data) && data[0] && typeof data[0] === 'object' ? (data[0] as Record<string, unknown>) : null;
  if (!card || typeof card.id !== 'string') throw new ApiError('server', '/v1/models lists no model');
  return {
    id: card.id,
    maxModelLen: num(card.max_model_len) ?? num(card.context_length),
    profile: readProfile(card),
    inputModalities: readModalities(card),
  };
}

/** The Prometheus text of `/metrics`, or `null` when the server has none. */
export async function getMetricsText(signal?: AbortSignal): Promise<string | null> {
  try {
    const res = await fetch('/metrics', { signal, cache: 'no-store' });
    if (!res.ok) return null;
    const text = await res.text();
    // An SPA fallback would answer with our own HTML page: that is not metrics.
    if (/^\s*</.test(text)) return null;
    return text;
  } catch (e) {
    if (signal?.aborted) throw e;
    return null;
  }
}

/** The limits the selectors are bounded by: the smaller of the profile's and the model's, when reported. */
export function limits(model: ModelInfo | null): { maxContext?: number; maxPrefill?: number } {
  const a = model?.profile?.maxContext;
  const b = model?.maxModelLen;
  const maxContext = a && b ? Math.min(a, b) : (a ?? b);
  let maxPrefill = model?.profile?.maxPrefill;
  if (maxPrefill && maxContext) maxPrefill = Math.min(maxPrefill, maxContext);
  return { maxContext, maxPrefill };
}

/** A content part of an OpenAI chat message. */
export type ContentPart = { type: 'text'; text: string } | { type: 'image_url'; image_url: { url: string } };

/**
 * What a user message sends: its text (documents folded in, see `promptText`) as a plain string, or, when it holds
 * images, content parts: the images first, in the order attached, then the text (the order Qwen's vision models
 * are shown in their own examples: the picture, then the question about it).
 */
export function userContent(m: UserMessage): string | ContentPart[] {
  const text = promptText(m);
  if (!m.images?.length) return text;
  const parts: ContentPart[] = m.images.map((i) => ({ type: 'image_url', image_url: { url: i.dataUrl } }));
  if (text) parts.push({ type: 'text', text });
  return parts;
}

/** The body of `POST /v1/chat/completions` for a chat's history and settings. */
export function buildRequest(model: string | undefined, messages: Message[], s: ChatSettings): Record<string, unknown> {
  const wire: { role: string; content: string | ContentPart[] }[] = [];
  if (s.system.trim()) wire.push({ role: 'system', content: s.system.trim() });
  for (const m of messages) {
    if (m.role === 'user') wire.push({ role: 'user', content: userContent(m) });
    // Earlier reasoning is not sent back: it would fill the context, and the template does not need it.
    else if (m.content || !m.interrupted) wire.push({ role: 'assistant', content: m.content });
  }
  const body: Record<string, unknown> = {
    messages: wire,
    stream: true,
    stream_options: { include_usage: true },
    accuracy_level: s.accuracyLevel,
    chat_template_kwargs: { enable_thinking: s.thinking },
  };
  if (model) body.model = model;
  if (s.thinking && s.effort) body.reasoning_effort = s.effort;
  for (const k of ['temperature', 'top_p', 'top_k', 'min_p'] as const) {
    const v = s.sampling[k];
    if (v !== null && Number.isFinite(v)) body[k] = v;
  }
  // Nebula extensions, sent only when the person chose less than the profile's maximum.
  if (s.contextLength) body.max_context = s.contextLength;
  if (s.prefillLength) body.max_prefill = s.prefillLength;
  return body;
}

/** What a stream delivers, piece by piece. */
export interface StreamCallbacks {
  onReasoning(text: string): void;
  onContent(text: string): void;
}

export interface StreamResult {
  finishReason?: string;
  usage?: { prompt_tokens?: number; completion_tokens?: number; total_tokens?: number };
  /** llama.cpp-style timings, when the server sends them. */
  timings?: Record<string, number>;
  /** `performance.now()` of the first reasoning or answer text. */
  firstTokenAt?: number;
  /** Whether `[DONE]` arrived. */
  done: boolean;
}

/**
 * Applies one parsed chunk of the stream to `result`. Throws [`ApiError`] for an error event (an error after the
 * stream began is sent as `{"error": …}` then `[DONE]`).
 */
export function applyChunk(chunk: unknown, result: StreamResult, cb: StreamCallbacks, now: number): void {
  if (!chunk || typeof chunk !== 'object') return;
  const c = chunk as Record<string, unknown>;
  if ('error' in c && c.error) {
    const { message, code } = errorMessage(c, 'the generation failed');
    const kind = code === 'context_length_exceeded' ? 'too_long' : 'server';
    throw new ApiError(kind, message, undefined, undefined, code);
  }
  if (c.usage && typeof c.usage === 'object') result.usage = c.usage as StreamResult['usage'];
  if (c.timings && typeof c.timings === 'object') result.timings = c.timings as Record<string, number>;
  const choices = Array.isArray(c.choices) ? c.choices : [];
  for (const ch of choices) {
    if (!ch || typeof ch !== 'object') continue;
    const choice = ch as Record<string, unknown>;
    if ((choice.index ?? 0) !== 0) continue;
    const delta = (choice.delta ?? {}) as Record<string, unknown>;
    const reasoning = typeof delta.reasoning_content === 'string' ? delta.reasoning_content : typeof delta.reasoning === 'string' ? delta.reasoning : '';
    const content = typeof delta.content === 'string' ? delta.content : '';
    if ((reasoning || content) && result.firstTokenAt === undefined) result.firstTokenAt = now;
    if (reasoning) cb.onReasoning(reasoning);
    if (content) cb.onContent(content);
    if (typeof choice.finish_reason === 'string') result.finishReason = choice.finish_reason;
  }
}

/**
 * Sends a streamed chat completion and feeds its deltas to `cb`. Resolves when `[DONE]` arrives or the body ends;
 * rejects with [`ApiError`] (`aborted` when `signal` fired).
 */
export async function streamChat(
  body: Record<string, unknown>,
  cb: StreamCallbacks,
  signal: AbortSignal,
  clock: () => number = () => performance.now(),
): Promise<StreamResult> {
  let res: Response;
  try {
    res = await fetch('/v1/chat/completions', {
      method: 'POST',
      headers: { 'content-type': 'application/json', accept: 'text/event-stream' },
      body: JSON.stringify(body),
      signal,
    });
  } catch (e) {
    if (signal.aborted) throw new ApiError('aborted', 'stopped');
    throw new ApiError('unreachable', e instanceof Error ? e.message : String(e));
  }
  if (!res.ok) throw classifyHttpError(res.status, await readJson(res), res.headers.get('retry-after'));
  const result: StreamResult = { done: false };
  if (!res.body) throw new ApiError('server', 'the response has no body');
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  const parser = new SseParser();
  const handle = (data: string) => {
    if (data.trim() === '[DONE]') {
      result.done = true;
      return;
    }
    let json: unknown;
    try {
      json = JSON.parse(data);
    } catch {
      throw new ApiError('server', `the server sent an unreadable event: ${data.slice(0, 80)}`);
    }
    applyChunk(json, result, cb, clock());
  };
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      for (const ev of parser.push(value)) {
        handle(ev.data);
        if (result.done) break;
      }
      if (result.done) break;
    }
    if (!result.done) for (const ev of parser.end()) handle(ev.data);
  } catch (e) {
    if (signal.aborted) throw new ApiError('aborted', 'stopped');
    if (e instanceof ApiError) throw e;
    throw new ApiError('unreachable', `the connection broke: ${e instanceof Error ? e.message : String(e)}`);
  } finally {
    reader.cancel().catch(() => {});
  }
  if (!result.done && !result.finishReason) {
    throw new ApiError('server', 'the stream ended before the answer was complete');
  }
  return result;
}
