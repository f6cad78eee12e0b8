/** Per-answer statistics from a finished (or stopped) stream. */
import type { StreamResult } from './api';
import type { AnswerStats } from './types';

/**
 * `sentAt` and `endAt` are `performance.now()` values; `deltas` counts the text pieces received (a fallback for
 * the token count when the server sent no usage). `contextLimit` is the limit the answer ran under.
 */
export function answerStats(
  r: Pick<StreamResult, 'usage' | 'timings' | 'firstTokenAt' | 'finishReason'>,
  sentAt: number,
  endAt: number,
  deltas: number,
  contextLimit: number | undefined,
): AnswerStats {
  const s: AnswerStats = {};
  const t = r.timings ?? {};
  s.promptTokens = r.usage?.prompt_tokens ?? (typeof t.prompt_n === 'number' ? t.prompt_n : undefined);
  s.completionTokens = r.usage?.completion_tokens ?? (typeof t.predicted_n === 'number' ? t.predicted_n : undefined);
  if (r.firstTokenAt !== undefined) s.ttftMs = r.firstTokenAt - sentAt;
  if (typeof t.predicted_per_second === 'number' && t.predicted_per_second > 0) {
    s.tokensPerSecond = t.predicted_per_second;
  } else if (r.firstTokenAt !== undefined) {
    const n = s.completionTokens ?? deltas;
    const secs = (endAt - r.firstTokenAt) / 1000;
    // The first token's time is TTFT; the rate counts the tokens after it.
    if (n > 1 && secs > 0) s.tokensPerSecond = (n - 1) / secs;
  }
  if (s.promptTokens !== undefined) s.contextUsed = s.promptTokens + (s.completionTokens ?? 0);
  s.contextLimit = contextLimit;
  s.finishReason = r.finishReason;
  return s;
}
