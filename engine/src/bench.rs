//! `nebula bench model`: prefill and decode speed at context frontiers, on any backend.
//!
//! For each frontier `c` the benchmark prefills `c` random tokens in chunks (prefill tok/s, time to first token
//! = prefill + the first logits), then decodes `n` greedy tokens (decode tok/s at that context). Results print as a
//! table and can be written as CSV. Alongside, it reports the bytes one decode step must read (weights of the
//! dense trunk, the routed experts actually used, the head row, KV and recurrent state) and, on a GPU, the
//! measured device copy bandwidth, so decode speed is shown as a fraction of the memory-bandwidth floor.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use crate::backend::{Backend, BackendError};
use crate::model::{LayerKind, LogitsFor, ModelConfig};
use crate::sampling::argmax;
use crate::synth::routing::{RoutingLog, RoutingStats, stream_key};

/// Benchmark settings.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Context sizes to measure at.
    pub contexts: Vec<usize>,
    /// Tokens decoded at each frontier.
    pub decode_tokens: usize,
    /// Prefill chunk size.
    pub prefill_chunk: usize,
    /// Seed of the random prompt.
    pub seed: u64,
    /// The model's routing log ([`crate::model::Qwen4Exp::set_routing_log`]), read around each frontier's timed
    /// decode steps into [`BenchRow::routing`]; `None`: not collected.
    pub routing_log: Option<Arc<RoutingLog>>,
}

/// One frontier's figures.
#[derive(Debug, Clone)]
pub struct BenchRow {
    /// Context size.
    pub context: usize,
    /// Prefill tokens per second.
    pub prefill_tok_s: f64,
    /// Time to first token, ms.
    pub ttft_ms: f64,
    /// Decode tokens per second at this context.
    pub decode_tok_s: f64,
    /// Mean decode step, ms.
    pub decode_ms: f64,
    /// Per-kernel (name, seconds, launches) of this frontier's prefill, when the CUDA runner profiles kernels
    /// (`NEBULA_CUDA_PROFILE=kernels`); empty otherwise.
    pub prefill_kernels: Vec<(String, f64, u64)>,
    /// Per-phase (name, seconds, count) of this frontier's prefill (`NEBULA_CUDA_PROFILE=1`); empty otherwise.
    pub prefill_phases: Vec<(&'static str, f64, u64)>,
    /// Hybrid streamed prefill's copy/compute timeline (`NEBULA_CUDA_PROFILE=copies`), when recorded.
    pub prefill_copies: Option<String>,
    /// Per-kernel times of the timed decode steps (`NEBULA_CUDA_PROFILE=kernels`), when recorded.
    pub decode_kernels: Vec<(String, f64, u64)>,
    /// Per-phase times of the timed decode steps (`NEBULA_CUDA_PROFILE=1`), when recorded.
    pub decode_phases: Vec<(&'static str, f64, u64)>,
    /// Hybrid decode only: where the decode steps' time went, and the routed expert uses the CPU computed
    /// (from the placement counters over the timed steps).
    pub hybrid: Option<HybridDecode>,
    /// The routing the timed decode steps used as the host saw it ([`BenchOptions::routing_log`]: the CPU
    /// forward, the hybrid CPU path); `None` without a log or where nothing was seen (all-GPU).
    pub routing: Option<RoutingStats>,
    /// The routing stream of the frontier's prompt ([`crate::synth::routing::stream_key`] of its first token) and
    /// the positions the timed decode steps consumed: where a routing override's statistics are read.
    pub decode_rows: (u64, Range<usize>),
}

/// The split of hybrid decode steps (see [`crate::backend::cuda::hybrid`]), per token.
#[derive(Debug, Clone, Copy)]
pub struct HybridDecode {
    /// CPU expert time, ms per token.
    pub cpu_ms: f64,
    /// Host waiting for the GPU, ms per token.
    pub wait_ms: f64,
    /// GPU critical-path work, ms per token.
    pub gpu_ms: f64,
    /// Round trips per token.
    pub trips: f64,
    /// Routed expert uses per token computed by the CPU (RAM and SSD tiers).
    pub cpu_experts: f64,
    /// Routed expert uses per token computed by the GPU.
    pub gpu_experts: f64,
    /// Token-layers handed to the CPU per token.
    pub handoffs: f64,
    /// Expert reads from SSD per token that a compute step needed: its own reads plus prefetches it used (a
    /// share of the SSD-tier uses in `cpu_experts`; the rest were still in the pool).
    pub ssd_needed: f64,
    /// Expert reads from SSD per token, prefetches that went unused included.
    pub ssd_reads: f64,
    /// Experts the adaptive GPU expert cache uploaded per token.
    pub cache_uploads: f64,
}

impl BenchRow {
    /// CSV header.
    pub const CSV_HEADER: &'static str = "context,prefill_tok_s,ttft_ms,decode_tok_s,decode_ms_per_token";
    /// One CSV line.
    pub fn csv(&self) -> String {
        format!(
            "{},{:.1},{:.2},{:.2},{:.3}",
            self.context, self.prefill_tok_s, self.ttft_ms, self.decode_tok_s, self.decode_ms
        )
    }
}

/// Runs the benchmark.
pub fn run<B: Backend>(runner: &B, opts: &BenchOptions) -> Result<Vec<BenchRow>, BackendError> {
    let vocab = runner.config().vocab as u64;
    let mut rows = Vec::new();
    for &ctx in &opts.contexts {
        // Plain decoding: no MTP cache to keep aligned.
        let mut st = runner.new_state(ctx + opts.decode_tokens + 1, false)?;
        let mut x = opts.seed | 1;
        // Random ordinary tokens (below the special-token range when the vocabulary is Qwen's).
        let limit = vocab.min(248_000);
        let prompt: Vec<u32> = (0..ctx)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % limit) as u32
            })
            .collect();
        // Untimed warm-up on a throwaway state with the first chunk's shape (as llama-bench's warm-up run): lazy
        // kernel loading and library heuristics are not part of prefill speed.
        {
            let first = &prompt[..prompt.len().min(opts.prefill_chunk.max(1))];
            let mut warm = runner.new_state(first.len() + 1, false)?;
            runner.forward(&mut warm, first, LogitsFor::Last)?;
        }
        runner.take_timings()?;
        let t0 = Instant::now();
        let mut logits = Vec::new();
        let chunks: Vec<&[u32]> = prompt.chunks(opts.prefill_chunk.max(1)).collect();
        for (i, c) in chunks.iter().enumerate() {
            let want = if i + 1 == chunks.len() { LogitsFor::Last } else { LogitsFor::None };
            logits = runner.forward(&mut st, c, want)?;
        }
        let prefill_s = t0.elapsed().as_secs_f64();
        let prefill = runner.take_timings()?;
        let (prefill_kernels, prefill_phases, prefill_copies) = (prefill.kernels, prefill.phases, prefill.copies);
        let mut tok = argmax(&logits).unwrap_or(0) as u32;
        let ttft_ms = t0.elapsed().as_secs_f64() * 1e3;
        // One untimed step warms up decode-shaped kernels.
        logits = runner.forward(&mut st, &[tok], LogitsFor::Last)?;
        tok = argmax(&logits).unwrap_or(0) as u32;
        // Profiles (NEBULA_CUDA_PROFILE) then cover decode only: what prefill and the warm-up step left is dropped.
        runner.take_timings()?;
        let stats0 = runner.placement_stats().map(|s| s.snapshot());
        if let Some(log) = &opts.routing_log {
            log.take();
        }
        let t1 = Instant::now();
        for _ in 0..opts.decode_tokens {
            logits = runner.forward(&mut st, &[tok], LogitsFor::Last)?;
            tok = argmax(&logits).unwrap_or(0) as u32;
        }
        let dec_s = t1.elapsed().as_secs_f64();
        let routing = opts.routing_log.as_ref().map(|l| l.take()).filter(|s| s.lookups() > 0);
        let decode = runner.take_timings()?;
        let hybrid = match (decode.hybrid, stats0, runner.placement_stats()) {
            (Some(t), Some(s0), Some(s1)) => Some({
                let s1 = s1.snapshot();
                let per = opts.decode_tokens.max(1) as f64;
                HybridDecode {
                    cpu_ms: t.cpu_s * 1e3 / per,
                    wait_ms: t.wait_s * 1e3 / per,
                    gpu_ms: t.gpu_s * 1e3 / per,
                    trips: t.trips as f64 / per,
                    cpu_experts: ((s1.expert_hits_ram + s1.expert_hits_ssd) - (s0.expert_hits_ram + s0.expert_hits_ssd))
                        as f64
                        / per,
                    gpu_experts: (s1.expert_hits_gpu - s0.expert_hits_gpu) as f64 / per,
                    handoffs: (s1.handoffs - s0.handoffs) as f64 / per,
                    ssd_needed: ((s1.ssd_expert_reads - s0.ssd_expert_reads)
                        - (s1.prefetch_issued - s0.prefetch_issued)
                        + (s1.prefetch_hits - s0.prefetch_hits)) as f64
                        / per,
                    ssd_reads: (s1.ssd_expert_reads - s0.ssd_expert_reads) as f64 / per,
                    cache_uploads: (s1.cache_uploads - s0.cache_uploads) as f64 / per,
                }
            }),
            _ => None,
        };
        rows.push(BenchRow {
            context: ctx,
            prefill_tok_s: ctx as f64 / prefill_s,
            ttft_ms,
            decode_tok_s: opts.decode_tokens as f64 / dec_s,
            decode_ms: dec_s * 1e3 / opts.decode_tokens.max(1) as f64,
            prefill_kernels,
            prefill_phases,
            prefill_copies,
            decode_kernels: decode.kernels,
            decode_phases: decode.phases,
            hybrid,
            routing,
            decode_rows: (stream_key(prompt.first().copied().unwrap_or(0)), ctx + 1..ctx + 1 + opts.decode_tokens),
        });
    }
    Ok(rows)
}

/// Bytes a decode step reads at context `ctx`, given the bytes per weight of each kind (from the loaded model):
/// every dense trunk weight, `n_expert_used` routed experts per layer, one head row per vocabulary entry (the
/// whole head: greedy decoding needs every logit), the attention KV of the selected tokens and the Gated DeltaNet
/// states (read and written).
#[derive(Debug, Clone, Copy)]
pub struct DecodeBytes {
    /// Dense weights (everything but routed experts), bytes.
    pub dense: u64,
    /// Routed expert weights actually used, bytes.
    pub experts: u64,
    /// KV cache and recurrent state traffic, bytes.
    pub state: u64,
}

impl DecodeBytes {
    /// Total bytes.
    pub fn total(&self) -> u64 {
        self.dense + self.experts + self.state
    }
}

/// Computes [`DecodeBytes`] for `cfg` from the weight bytes of the model: `dense_weight_bytes` is every weight but
/// the routed experts and the n-gram table, `expert_bytes` one expert's gate + up + down.
pub fn decode_bytes(cfg: &ModelConfig, dense_weight_bytes: u64, expert_bytes: u64, ctx: usize) -> DecodeBytes {
    let mut state = 0u64;
    for kind in &cfg.layer_kinds {
        match kind {
            LayerKind::LinearAttention => {
                // S is read and written; f32.
                state += 2 * (cfg.ssm_v_heads * cfg.ssm_head_dim * cfg.ssm_head_dim * 4) as u64;
            }
            LayerKind::IndexedAttention { compress_ratio } => {
                // The selected keys and values, and every pooled block key, in the cache's type.
                let keys =
                    if *compress_ratio > 0 { ctx.min(cfg.indexer.token_budget + compress_ratio - 1) } else { ctx };
                let [kv, _, pooled] = cfg.attention_row_bytes(*compress_ratio);
                state += (2 * keys * kv) as u64;
                if *compress_ratio > 0 {
                    state += ((ctx / compress_ratio) * pooled) as u64;
                }
            }
        }
    }
    DecodeBytes { dense: dense_weight_bytes, experts: expert_bytes * (cfg.n_expert_used * cfg.n_layer) as u64, state }
}

/// Sum of 64-bit words, vectorized with AVX2 when the CPU has it.
fn sum_words(v: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        fn sum_avx2(v: &[u64]) -> u64 {
            sum_plain(v)
        }
        if is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            return unsafe { sum_avx2(v) };
        }
    }
    sum_plain(v)
}

#[inline(always)]
fn sum_plain(v: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    for c in v.chunks_exact(8) {
        for i in 0..8 {
            acc[i] = acc[i].wrapping_add(c[i]);
        }
    }
    acc.iter().fold(0u64, |a, &b| a.wrapping_add(b))
}

/// DRAM read bandwidth in bytes/s with `threads` threads: a buffer of `bytes` (much larger than the caches)
/// summed for about `seconds` (a STREAM-like read pass; `nebula bench kernels`, the hybrid backend's cost model
/// and `bench model`'s hybrid floor all use it).
///
/// Errors: the thread pool cannot be built.
pub fn dram_read_bandwidth(threads: usize, bytes: usize, seconds: f64) -> Result<f64, rayon::ThreadPoolBuildError> {
    use rayon::prelude::*;
    let buf: Vec<u64> = (0..(bytes / 8) as u64).into_par_iter().collect();
    read_bandwidth(&buf, threads, seconds)
}

/// Read bandwidth in bytes/s with `threads` threads over `buf`: passes over it for at least `seconds` (and at
/// least two), each thread summing its share.
///
/// Errors: the thread pool cannot be built.
pub fn read_bandwidth(buf: &[u64], threads: usize, seconds: f64) -> Result<f64, rayon::ThreadPoolBuildError> {
    let p = rayon::ThreadPoolBuilder::new().num_threads(threads).build()?;
    let pass = || {
        p.broadcast(|ctx| {
            let n = buf.len();
            let (i, k) = (ctx.index(), ctx.num_threads());
            std::hint::black_box(sum_words(&buf[n * i / k..n * (i + 1) / k]))
        });
    };
    pass();
    let start = Instant::now();
    let mut passes = 0u64;
    while start.elapsed().as_secs_f64() < seconds || passes < 2 {
        pass();
        passes += 1;
    }
    Ok(passes as f64 * (buf.len() * 8) as f64 / start.elapsed().as_secs_f64())
}
