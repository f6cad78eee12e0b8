/**
 * A reader of the Prometheus text exposition format, enough for the status page: samples with labels, HELP and
 * TYPE lines, and the vLLM-compatible names Nebula exports.
 */
export interface Sample {
  name: string;
  labels: Record<string, string>;
  value: number;
}

export interface MetricFamily {
  name: string;
  help?: string;
  type?: string;
  samples: Sample[];
}

function unescapeLabel(s: string): string {
  return s.replace(/\\(["\\n])/g, (_, c: string) => (c === 'n' ? '\n' : c));
}

function parseValue(s: string): number {
  if (s === '+Inf') return Infinity;
  if (s === '-Inf') return -Infinity;
  return Number(s);
}

/** Parses exposition text into families, in the order they appear. Unreadable lines are skipped. */
export function parsePrometheus(text: string): MetricFamily[] {
  const families = new Map<string, MetricFamily>();
  const family = (name: string) => {
    let f = families.get(name);
    if (!f) {
      f = { name, samples: [] };
      families.set(name, f);
    }
    return f;
  };
  // Histogram and summary samples belong to the family without their suffix.
  const familyOf = (sample: string) => {
    const m = /^(.*)_(bucket|sum|count|total|created)$/.exec(sample);
    if (m && families.has(m[1]) && families.get(m[1])!.type !== undefined) return m[1];
    return sample;
  };
  for (const raw of text.split('\n')) {
    const line = raw.trim();
    if (!line) continue;
    if (line.startsWith('#')) {
      const m = /^#\s+(HELP|TYPE)\s+(\S+)\s*(.*)$/.exec(line);
      if (m) {
        const f = family(m[2]);
        if (m[1] === 'HELP') f.help = m[3].replace(/\\n/g, '\n').replace(/\\\\/g, '\\');
        else f.type = m[3];
      }
      continue;
    }
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$/.exec(line);
    if (!m) continue;
    const labels: Record<string, string> = {};
    if (m[3]) {
      for (const l of m[3].matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = unescapeLabel(l[2]);
    }
    const value = parseValue(m[4]);
    if (Number.isNaN(value) && m[4] !== 'NaN') continue;
    family(familyOf(m[1])).samples.push({ name: m[1], labels, value });
  }
  return [...families.values()].filter((f) => f.samples.length > 0);
}

/** Sum of the samples named `name` (across labels), or `undefined` when there is none. */
export function total(families: MetricFamily[], name: string): number | undefined {
  let sum: number | undefined;
  for (const f of families) for (const s of f.samples) if (s.name === name) sum = (sum ?? 0) + s.value;
  return sum;
}

/** Mean of a histogram (`_sum` / `_count`), or `undefined`. */
export function histogramMean(families: MetricFamily[], name: string): number | undefined {
  const sum = total(families, `${name}_sum`);
  const count = total(families, `${name}_count`);
  return sum !== undefined && count ? sum / count : undefined;
}
