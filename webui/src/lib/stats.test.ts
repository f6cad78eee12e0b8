import { describe, expect, it } from 'vitest';
import { answerStats } from './stats';

describe('answerStats', () => {
  it('takes tokens from usage, TTFT from the first delta and speed from the tokens after it', () => {
    const s = answerStats({ usage: { prompt_tokens: 100, completion_tokens: 11 }, firstTokenAt: 1250, finishReason: 'stop' }, 1000, 3250, 11, 4096);
    expect(s).toEqual({ promptTokens: 100, completionTokens: 11, ttftMs: 250, tokensPerSecond: 5, contextUsed: 111, contextLimit: 4096, finishReason: 'stop' });
  });

  it('prefers the server timings, and falls back to counting deltas', () => {
    expect(answerStats({ timings: { predicted_per_second: 42, prompt_n: 7, predicted_n: 3 }, firstTokenAt: 1 }, 0, 2, 3, undefined)).toMatchObject({ tokensPerSecond: 42, promptTokens: 7, completionTokens: 3 });
    expect(answerStats({ firstTokenAt: 0 }, 0, 1000, 6, undefined).tokensPerSecond).toBe(5);
    expect(answerStats({}, 0, 1000, 0, 8).tokensPerSecond).toBeUndefined();
  });
});
