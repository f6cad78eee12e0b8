import { describe, expect, it } from 'vitest';
import { histogramMean, parsePrometheus, total } from './metrics';

const TEXT = `# HELP vllm:num_requests_running Number of requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="nebula-demo"} 1.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="nebula-demo"} 1234 1700000000000
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="nebula-demo"} 2
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="nebula-demo"} 4
vllm:time_to_first_token_seconds_sum{model_name="nebula-demo"} 0.8
vllm:time_to_first_token_seconds_count{model_name="nebula-demo"} 4
# TYPE nebula:expert_hits_total counter
nebula:expert_hits_total{tier="gpu",note="a \\"quoted\\" \\\\ value"} 10
nebula:expert_hits_total{tier="ssd"} 5
garbage line here
nebula:nan_gauge NaN
`;

describe('parsePrometheus', () => {
  const f = parsePrometheus(TEXT);

  it('groups samples into families with help and type, histograms under their base name', () => {
    expect(f.map((x) => x.name)).toEqual([
      'vllm:num_requests_running',
      'vllm:generation_tokens_total',
      'vllm:time_to_first_token_seconds',
      'nebula:expert_hits_total',
      'nebula:nan_gauge',
    ]);
    expect(f[0]).toMatchObject({ help: 'Number of requests running.', type: 'gauge' });
    expect(f[2].samples).toHaveLength(4);
  });

  it('reads labels with escapes, timestamps and special values', () => {
    expect(f[3].samples[0].labels).toEqual({ tier: 'gpu', note: 'a "quoted" \\ value' });
    expect(total(f, 'vllm:generation_tokens_total')).toBe(1234);
    expect(total(f, 'nebula:expert_hits_total')).toBe(15);
    expect(f[2].samples[1].labels.le).toBe('+Inf');
    expect(Number.isNaN(f[4].samples[0].value)).toBe(true);
  });

  it('computes histogram means and says undefined for what is missing', () => {
    expect(histogramMean(f, 'vllm:time_to_first_token_seconds')).toBeCloseTo(0.2);
    expect(histogramMean(f, 'vllm:e2e_request_latency_seconds')).toBeUndefined();
    expect(total(f, 'vllm:num_requests_waiting')).toBeUndefined();
  });
});
