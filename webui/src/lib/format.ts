/** Number formatting for stats and the status page. */
export function fmtInt(n: number | undefined): string {
  return n === undefined || !Number.isFinite(n) ? '–' : Math.round(n).toLocaleString('en-US');
}

export function fmtTokens(n: number): string {
  if (n >= 1024 && n % 1024 === 0) return `${n / 1024}k`;
  return fmtInt(n);
}

export function fmtMs(ms: number | undefined): string {
  if (ms === undefined || !Number.isFinite(ms)) return '–';
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

export function fmtRate(r: number | undefined): string {
  if (r === undefined || !Number.isFinite(r)) return '–';
  return r >= 100 ? r.toFixed(0) : r.toFixed(1);
}

/** Options for a token-count selector: common sizes up to `max`, and `max` itself. */
export function tokenOptions(max: number | undefined, common: number[]): number[] {
  if (!max) return [];
  const opts = common.filter((n) => n < max);
  opts.push(max);
  return opts;
}

export const CONTEXT_SIZES = [1024, 2048, 4096, 8192, 16384, 24576, 32768, 49152, 65536, 98304, 131072, 262144];
export const PREFILL_SIZES = [256, 512, 1024, 2048, 4096, 8192];
