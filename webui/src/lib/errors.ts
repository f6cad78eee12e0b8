/**
 * Failures of the API, sorted into what a person can act on. The server answers errors with OpenAI's body
 * `{"error": {"message", "type", "param", "code"}}`; nginx answers 502/504 when the API container is unreachable.
 */
export type ErrorKind =
  | 'unreachable' // no answer at all, or nginx could not reach the API
  | 'loading' // 503 while the model loads
  | 'busy' // 429: the queue is full
  | 'too_long' // 400 context_length_exceeded, 413
  | 'auth' // 401/403
  | 'not_found' // 404 (another model id)
  | 'bad_request' // other 4xx
  | 'server' // 5xx and errors sent inside the stream
  | 'aborted'; // the user pressed Stop

export class ApiError extends Error {
  constructor(
    readonly kind: ErrorKind,
    message: string,
    readonly status?: number,
    /** Seconds to wait before retrying (429 `Retry-After`). */
    readonly retryAfter?: number,
    /** OpenAI `error.code` when the server sent one. */
    readonly code?: string,
  ) {
    super(message);
    this.name = 'ApiError';
  }
}

/** Text a person reads for an error: a title and one or two sentences. */
export interface FriendlyError {
  title: string;
  detail: string;
  /** Whether sending again may work without changing anything. */
  retryable: boolean;
}

/** Reads an OpenAI-style error body (or anything else) into a message. */
export function errorMessage(body: unknown, fallback: string): { message: string; code?: string; type?: string } {
  if (body && typeof body === 'object' && 'error' in body) {
    const e = (body as { error: unknown }).error;
    if (e && typeof e === 'object') {
      const o = e as Record<string, unknown>;
      return {
        message: typeof o.message === 'string' && o.message ? o.message : fallback,
        code: typeof o.code === 'string' ? o.code : undefined,
        type: typeof o.type === 'string' ? o.type : undefined,
      };
    }
    if (typeof e === 'string') return { message: e };
  }
  return { message: fallback };
}

/** Sorts an HTTP error response into an [`ApiError`]. `body` is the parsed JSON (or the text) of the response. */
export function classifyHttpError(status: number, body: unknown, retryAfterHeader: string | null): ApiError {
  const { message, code, type } = errorMessage(body, `HTTP ${status}`);
  const retry = retryAfterHeader !== null && /^\d+$/.test(retryAfterHeader.trim()) ? Number(retryAfterHeader) : undefined;
  const statusField = body && typeof body === 'object' ? (body as Record<string, unknown>).status : undefined;
  if (status === 429) return new ApiError('busy', message, status, retry, code);
  if (status === 413 || code === 'context_length_exceeded' || /maximum context length|context length|too long/i.test(message))
    return new ApiError('too_long', message, status, undefined, code);
  if (status === 503 && (statusField === 'loading' || /load/i.test(message)))
    return new ApiError('loading', message, status, retry, code);
  if (status === 502 || status === 504 || code === 'api_unreachable' || type === 'api_unreachable')
    return new ApiError('unreachable', message, status, undefined, code);
  if (status === 401 || status === 403) return new ApiError('auth', message, status, undefined, code);
  if (status === 404) return new ApiError('not_found', message, status, undefined, code);
  if (status >= 400 && status < 500) return new ApiError('bad_request', message, status, undefined, code);
  return new ApiError('server', message, status, retry, code);
}

/** What to tell the person about `err`. */
export function friendly(err: unknown): FriendlyError {
  if (!(err instanceof ApiError)) {
    const msg = err instanceof Error ? err.message : String(err);
    return { title: 'Something went wrong', detail: msg, retryable: true };
  }
  switch (err.kind) {
    case 'unreachable':
      return {
        title: 'The Nebula server is not reachable',
        detail: 'The API did not answer. Check that `nebula serve` (or its container) is running; this page keeps checking and will say when it is back.',
        retryable: true,
      };
    case 'loading':
      return {
        title: 'The model is still loading',
        detail: 'Nebula is loading the model. Your message can be sent again as soon as it is ready.',
        retryable: true,
      };
    case 'busy':
      return {
        title: 'Nebula is busy',
        detail:
          'Every slot is taken and the queue is full (HTTP 429).' +
          (err.retryAfter !== undefined ? ` Try again in ${err.retryAfter} s.` : ' Try again in a moment.'),
        retryable: true,
      };
    case 'too_long':
      return {
        title: 'The prompt is too long',
        detail: `${err.message} Start a new chat, remove an attached document, or pick a larger context if the profile allows it.`,
        retryable: false,
      };
    case 'auth':
      return {
        title: 'The server refused the request',
        detail: `${err.message} The API needs a key: set NEBULA_API_KEY for the WebUI container.`,
        retryable: false,
      };
    case 'not_found':
      return { title: 'Not found', detail: err.message, retryable: false };
    case 'bad_request':
      return { title: 'The server rejected the request', detail: err.message, retryable: false };
    case 'aborted':
      return { title: 'Stopped', detail: 'You stopped the answer.', retryable: true };
    case 'server':
    default:
      return { title: 'The server failed', detail: err.message, retryable: true };
  }
}
