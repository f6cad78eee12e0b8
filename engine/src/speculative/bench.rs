//! `nebula bench mtp`: decode speed with MTP off and on, per accuracy level, and the machinery's own cost at fixed
//! acceptance rates (the scripted test drafter), measured in one run on the CPU model or the GPU model (all-GPU or hybrid).
//!
//! Every run prefills the same random prompt and decodes the same number of tokens (no stop tokens), timing the
//! decode only. Rows:
//! - `off`: plain greedy decoding (its output is the reference of the scripted rows);
//! - `mtp L3` / `L2` / `L1`: the model's MTP block drafting, greedy verification at that level;
//! - `mtp T=0.7`: sampling with speculative-sampling acceptance;
//! - `rate R +mtp`: the scripted drafter proposes the reference token with probability `R` (else a wrong one)
//!   after running the real MTP draft (its cost is paid, its tokens discarded), verified at level 3;
//! - `rate R free`: the same without running the MTP (drafting costs nothing: the verify/rollback machinery
//!   alone, the ceiling of the speed-up at that acceptance).
//!
//! On random weights (synthetic models, or the demo model with a random MTP block appended) the MTP's own
//! acceptance is meaningless; the `rate` rows are the speed-up curve that matters there.

use std::time::Instant;

use crate::backend::{Backend, BackendError};
use crate::model::{LogitsFor, ModelError};
use crate::sampling::{Sampler, SamplingParams};
use crate::worker::FinishReason;

use super::decoder::{Flow, SpeculativeDecoder, SpeculativeOptions, TokenSink};
use super::scripted::{DraftPlan, ScriptedDrafter};
use super::stats::DecodeReport;
use super::verify::AccuracyLevel;

/// Settings of the benchmark.
#[derive(Debug, Clone)]
pub struct MtpBenchOptions {
    /// Random prompt tokens prefilled before each run.
    pub prompt_tokens: usize,
    /// Tokens decoded per run.
    pub decode_tokens: usize,
    /// Levels run with the model's MTP drafting.
    pub levels: Vec<AccuracyLevel>,
    /// Acceptance rates of the scripted drafter.
    pub rates: Vec<f64>,
    /// Seed of the prompt and the scripted drafter.
    pub seed: u64,
    /// Chain lengths (rows) whose verify pass is timed on its own ([`pass_costs`]); empty: none.
    pub pass_rows: Vec<usize>,
}

impl MtpBenchOptions {
    /// The routing stream of the benchmark's prompt for a vocabulary of `vocab` ids
    /// ([`crate::synth::routing::stream_key`] of its first token) and the positions its runs decode: where a
    /// routing override's statistics are read.
    pub fn decode_rows(&self, vocab: usize) -> (u64, std::ops::Range<usize>) {
        let p = prompt(vocab, self.prompt_tokens.max(1), self.seed);
        let start = p.len();
        (crate::synth::routing::stream_key(p[0]), start..start + self.decode_tokens.max(1))
    }
}

impl Default for MtpBenchOptions {
    fn default() -> Self {
        Self {
            prompt_tokens: 256,
            decode_tokens: 128,
            levels: vec![AccuracyLevel::Strict, AccuracyLevel::Balanced, AccuracyLevel::Relaxed],
            rates: vec![0.5, 0.7, 0.9],
            seed: 7,
            pass_rows: vec![1, 2, 4, 8],
        }
    }
}

/// One run's figures.
#[derive(Debug, Clone)]
pub struct MtpBenchRow {
    /// What ran.
    pub label: String,
    /// Decoded tokens per second.
    pub tok_s: f64,
    /// Against the `off` row.
    pub speedup: f64,
    /// Decode seconds.
    pub decode_s: f64,
    /// Tokens decoded.
    pub tokens: usize,
    /// The speculative counters of the run.
    pub report: DecodeReport,
}

impl MtpBenchRow {
    /// CSV header.
    pub const CSV_HEADER: &'static str = "run,tok_s,speedup,acceptance,mean_accepted_length,chains_a,chains_b,chains_c,\
                                          collapses,draft_s,verify_s,rollback_s,realign_s,exact_s,plain_s,decode_s";
    /// One CSV line.
    pub fn csv(&self) -> String {
        let r = &self.report;
        format!(
            "{},{:.2},{:.3},{:.3},{:.3},{},{},{},{},{:.4},{:.4},{:.4},{:.4},{:.4},{:.4},{:.4}",
            self.label,
            self.tok_s,
            self.speedup,
            r.acceptance_rate(),
            r.mean_accepted_length(),
            r.chains[0],
            r.chains[1],
            r.chains[2],
            r.collapses,
            r.draft_s,
            r.verify_s,
            r.save_s + r.restore_s,
            r.realign_s,
            r.exact_s,
            r.plain_s,
            self.decode_s
        )
    }
}

/// Collects `max` tokens, no stop tokens; reads no logits (greedy plain steps choose on the model's side, as a
/// server request without log-probabilities or a grammar does).
struct Collect {
    out: Vec<u32>,
    max: usize,
}

impl<M: Backend> TokenSink<M> for Collect {
    fn mask(&mut self, _logits: &mut [f32]) -> Result<(), String> {
        Ok(())
    }
    fn commit(&mut self, token: u32, _logits: &[f32], room: bool) -> Result<Flow, String> {
        self.out.push(token);
        Ok(if self.out.len() >= self.max || !room { Flow::Finish(FinishReason::Length) } else { Flow::Continue })
    }
    fn remaining(&self) -> usize {
        self.max.saturating_sub(self.out.len())
    }
    fn needs_logits(&self) -> bool {
        false
    }
}

/// The random prompt of the benchmark (ordinary tokens below the special range of Qwen's vocabulary).
fn prompt(vocab: usize, n: usize, seed: u64) -> Vec<u32> {
    let mut x = seed | 1;
    let limit = (vocab as u64).min(248_000);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % limit) as u32
        })
        .collect()
}

/// Prefills `tokens` in chunks of 512; returns the state and the last logits.
/// A fresh state for `cap` tokens (drafting on) after prefilling `tokens` in chunks of 512, with the last row's
/// logits.
///
/// Errors: as the backend's forward pass.
fn prefill<B: Backend>(model: &B, tokens: &[u32], cap: usize) -> Result<(B::State, Vec<f32>), BackendError> {
    let mut s = model.new_state(cap, true)?;
    let mut logits = Vec::new();
    let chunks: Vec<&[u32]> = tokens.chunks(512).collect();
    for (i, c) in chunks.iter().enumerate() {
        let want = if i + 1 == chunks.len() { LogitsFor::Last } else { LogitsFor::None };
        logits = model.forward(&mut s, c, want)?;
    }
    Ok((s, logits))
}

fn decode_run<T: Backend, M: Backend<State = T::State>>(
    target: &T,
    model: &M,
    prompt: &[u32],
    n: usize,
    params: SamplingParams,
    opts: SpeculativeOptions,
) -> Result<(Vec<u32>, f64, DecodeReport), BackendError> {
    let (mut state, logits) = prefill(target, prompt, prompt.len() + n + 1)?;
    let mut sampler = Sampler::new(params);
    let mut sink = Collect { out: Vec::with_capacity(n), max: n };
    let mut dec = SpeculativeDecoder::new(model, opts, None);
    let limit = prompt.len() + n + 1;
    let t = Instant::now();
    dec.run(&mut state, logits, &mut sampler, &mut sink, limit).map_err(|e| match e {
        super::DecodeError::Backend(b) => b,
        super::DecodeError::Request(reason) => ModelError::MtpUnavailable { reason }.into(),
    })?;
    Ok((sink.out, t.elapsed().as_secs_f64(), dec.report))
}

/// Runs the benchmark (see the module doc). `progress` is called with each row as it finishes.
///
/// Errors: a model error (bad prompt length for the model's context, no MTP block loaded).
pub fn run_mtp_bench<T: Backend>(
    model: &T,
    opts: &MtpBenchOptions,
    mut progress: impl FnMut(&MtpBenchRow),
) -> Result<Vec<MtpBenchRow>, BackendError> {
    if !model.has_mtp() {
        return Err(ModelError::MtpUnavailable { reason: "the model has no MTP block loaded".into() }.into());
    }
    let n = opts.decode_tokens.max(1);
    let p = prompt(model.vocab(), opts.prompt_tokens.max(1), opts.seed);
    let greedy = SamplingParams::GREEDY;
    let mut rows = Vec::new();
    let mut push = |label: String, out: &[u32], secs: f64, report: DecodeReport, base: Option<f64>| {
        let tok_s = out.len() as f64 / secs.max(1e-12);
        let row = MtpBenchRow {
            label,
            tok_s,
            speedup: base.map_or(1.0, |b| tok_s / b),
            decode_s: secs,
            tokens: out.len(),
            report,
        };
        progress(&row);
        rows.push(row);
        tok_s
    };
    let off = SpeculativeOptions { enabled: false, ..Default::default() };
    let (reference_out, secs, report) = decode_run(model, model, &p, n, greedy, off)?;
    let base = push("off".into(), &reference_out, secs, report, None);
    for &level in &opts.levels {
        let o = SpeculativeOptions { level, ..Default::default() };
        let (out, secs, report) = decode_run(model, model, &p, n, greedy, o)?;
        if level == AccuracyLevel::Strict && out != reference_out {
            return Err(
                ModelError::MtpUnavailable { reason: "level 3 output differs from plain decoding".into() }.into()
            );
        }
        push(format!("mtp L{}", level.number()), &out, secs, report, Some(base));
    }
    let sampled = SamplingParams { temperature: 0.7, seed: Some(opts.seed), ..SamplingParams::GREEDY };
    let (out, secs, report) = decode_run(model, model, &p, n, sampled, SpeculativeOptions::default())?;
    push("mtp T=0.7".into(), &out, secs, report, Some(base));
    let mut reference = p.clone();
    reference.extend_from_slice(&reference_out);
    for &rate in &opts.rates {
        for run_inner in [true, false] {
            let plan = DraftPlan::Rate { rate, seed: opts.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1 };
            let drafter = ScriptedDrafter::new(model, reference.clone(), plan, run_inner);
            let (out, secs, report) = decode_run(model, &drafter, &p, n, greedy, SpeculativeOptions::default())?;
            if out != reference_out {
                return Err(
                    ModelError::MtpUnavailable { reason: "scripted run differs from plain decoding".into() }.into()
                );
            }
            let what = if run_inner { "+mtp" } else { "free" };
            push(format!("rate {rate:.2} {what}"), &out, secs, report, Some(base));
        }
    }
    Ok(rows)
}

/// The cost of one pass of the machinery, from [`pass_costs`].
#[derive(Debug, Clone, Copy)]
pub struct PassCost {
    /// Rows of the verify pass (the pending token and `rows - 1` drafts).
    pub rows: usize,
    /// Median seconds of one verify pass of `rows` rows (logits of every row on the host), over the repeats.
    pub verify_s: f64,
    /// Median seconds of the rollback that drops the whole chain (the state back where it was).
    pub rollback_s: f64,
    /// Median seconds of one plain decode step at the same position (the reference: a pass costs
    /// `verify_s / step_s` steps).
    pub step_s: f64,
    /// Median seconds of one MTP draft step (a chain of `rows - 1` drafts costs about `rows - 1` of these).
    pub draft_s: f64,
}

/// Times each verify pass of `rows` rows alone (see [`PassCost`]), `repeats` times interleaved with plain steps
/// and single drafts, on a state that has prefilled `prompt_tokens` random tokens; the state is rolled back after
/// every pass, so every pass starts at the same position. The tokens are random (the pass's cost does not depend
/// on whether drafts are right).
///
/// Errors: as the backend's forward, draft, verify and rollback (no MTP block: drafting is skipped, `draft_s`
/// is 0).
pub fn pass_costs<B: Backend>(
    model: &B,
    prompt_tokens: usize,
    rows: &[usize],
    repeats: usize,
    seed: u64,
) -> Result<Vec<PassCost>, BackendError> {
    let p = prompt(model.vocab(), prompt_tokens.max(1), seed);
    let most = rows.iter().copied().max().unwrap_or(1);
    let (mut state, _) = prefill(model, &p, p.len() + most + 2)?;
    let chain = prompt(model.vocab(), most, seed ^ 0x5DEE_CE66);
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let mut out = Vec::new();
    for &k in rows.iter().filter(|&&k| k > 0) {
        let (mut verify, mut rollback, mut step, mut draft) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..repeats.max(1) {
            let snap = model.snapshot(&state)?;
            let t = Instant::now();
            model.step(&mut state, chain[0])?;
            step.push(t.elapsed().as_secs_f64());
            model.restore(&mut state, &snap)?;
            if model.has_mtp() && model.can_draft(&state) {
                let t = Instant::now();
                model.draft(&mut state, chain[0], 1)?;
                draft.push(t.elapsed().as_secs_f64());
            }
            let t = Instant::now();
            let v = model.verify(&mut state, &chain[..k])?;
            verify.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            model.rollback(&mut state, &v.record, 0)?;
            rollback.push(t.elapsed().as_secs_f64());
        }
        out.push(PassCost {
            rows: k,
            verify_s: median(verify),
            rollback_s: median(rollback),
            step_s: median(step),
            draft_s: median(draft),
        });
    }
    Ok(out)
}
