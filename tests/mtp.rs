//! MTP speculative decoding on real checkpoints:
//! - the MTP block's draft logits against an outside implementation (`scripts/make_mtp_golden.py`: a PyTorch
//!   head following SGLang's `Qwen4ExpForCausalLMMTP`, built from transformers' modules, on the golden `hc4_moe`
//!   trunk), through both the step-by-step and the batched-prefill paths;
//! - a verified chain rolled back to any prefix leaves exactly (bit for bit, MTP cache included) the state of
//!   decoding only that prefix, and its rows' logits are those of plain decoding;
//! - level 3 with MTP produces exactly the tokens of plain greedy decoding on every golden checkpoint (random MTP
//!   blocks appended) for long outputs;
//! - the scripted test drafter drives cases A, B and C, first-token rejection, window growth and shrink, a
//!   collapse and the recovery after it, with every state after a chain checked against plain decoding.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};

use nebula_engine::backend::{Backend, BackendError, HeldBytes, Kept};
use nebula_engine::model::Snapshot;
use nebula_engine::model::{LogitsFor, Qwen4Exp, SequenceState};
use nebula_engine::sampling::{Sampler, SamplingParams, argmax};
use nebula_engine::speculative::decoder::{FixedCosts, Flow, SpeculativeDecoder, SpeculativeOptions, TokenSink};
use nebula_engine::speculative::scripted::{DraftPlan, ScriptedDrafter};
use nebula_engine::synth::append_random_mtp;
use nebula_engine::worker::FinishReason;

fn root() -> PathBuf {
    nebula_tests::repo_root()
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// The `hc4_moe` golden trunk with the reference MTP block, converted to F32.
fn reference_mtp_model(tmp: &Path) -> Qwen4Exp {
    Qwen4Exp::load(&nebula_tests::reference_mtp_gguf(tmp)).unwrap()
}

/// A golden checkpoint converted to F32 with a random MTP block appended.
fn golden_with_random_mtp(name: &str, tmp: &Path) -> Qwen4Exp {
    let m = Qwen4Exp::load(&nebula_tests::golden_with_random_mtp_gguf(name, tmp)).unwrap();
    assert!(m.mtp().is_some());
    m
}

/// (max |a - b| / max |b|, rows whose argmax differs).
fn compare(ours: &[f32], reference: &[f32], vocab: usize) -> (f32, Vec<usize>) {
    assert_eq!(ours.len(), reference.len());
    let max_ref = reference.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = ours.iter().zip(reference).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    let differ = ours
        .chunks_exact(vocab)
        .zip(reference.chunks_exact(vocab))
        .enumerate()
        .filter(|(_, (a, b))| argmax(a) != argmax(b))
        .map(|(i, _)| i)
        .collect();
    (worst / max_ref, differ)
}

#[test]
fn mtp_draft_logits_match_the_reference_implementation() {
    let tmp = tempfile::tempdir().unwrap();
    let model = reference_mtp_model(tmp.path());
    let fx = root().join("tests/fixtures/golden_mtp/hc4_mtp");
    let meta = json(&fx.join("golden.json"));
    let tokens = ids(&meta["token_ids"]);
    let want_drafts = ids(&meta["drafts"]);
    let (p, k) = (meta["prefill"].as_u64().unwrap() as usize, meta["chain"].as_u64().unwrap() as usize);
    let vocab = model.config.vocab;
    let bytes = std::fs::read(fx.join("logits.bin")).unwrap();
    let reference: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    assert_eq!(reference.len(), (p + k - 1) * vocab);

    // Step by step: after each target token, the MTP row for the next one (row j reads H_j and x_{j+1}).
    let mut state = model.new_state(p + k + 4);
    let mut ours = Vec::new();
    for j in 0..p - 1 {
        model.forward(&mut state, &[tokens[j]], LogitsFor::None).unwrap();
        let d = model.draft(&mut state, tokens[j + 1], 1, true).unwrap();
        ours.extend_from_slice(&d.logits);
    }
    model.forward(&mut state, &[tokens[p - 1]], LogitsFor::None).unwrap();
    let chain = model.draft(&mut state, tokens[p], k, true).unwrap();
    ours.extend_from_slice(&chain.logits);
    if std::env::var("MTP_VERBOSE").is_ok() {
        for (i, (a, b)) in ours.chunks_exact(vocab).zip(reference.chunks_exact(vocab)).enumerate() {
            let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            println!("row {i}: max |delta| {d:.3e}");
        }
    }
    let (rel, differ) = compare(&ours, &reference, vocab);
    println!("MTP step by step: max |delta| / max |logit| = {rel:.2e}, top-1 mismatches {differ:?}");
    assert!(rel <= 2e-5, "relative error {rel:.2e} over the stated tolerance 2e-5");
    assert!(differ.is_empty(), "top-1 differs at rows {differ:?}");
    assert_eq!(chain.tokens, want_drafts, "chained drafts");

    // One batched prefill (chunked Gated DeltaNet, the aligned MTP rows in one batch), then the chain.
    let mut state = model.new_state(p + k + 4);
    model.forward(&mut state, &tokens[..p], LogitsFor::None).unwrap();
    let chain = model.draft(&mut state, tokens[p], k, true).unwrap();
    let (rel, differ) = compare(&chain.logits, &reference[(p - 1) * vocab..], vocab);
    println!("MTP after a batched prefill: {rel:.2e}, mismatches {differ:?}");
    assert!(rel <= 2e-5 && differ.is_empty());
    assert_eq!(chain.tokens, want_drafts);
}

/// Plain decoding states: `states[i]` after consuming `tokens[..p + i]` (prefill of `p`, then single steps), and
/// the logits of each single step.
fn plain_states(model: &Qwen4Exp, tokens: &[u32], p: usize, cap: usize) -> (Vec<SequenceState>, Vec<Vec<f32>>) {
    let mut s = model.new_state(cap);
    model.forward(&mut s, &tokens[..p], LogitsFor::None).unwrap();
    let mut states = vec![s.clone()];
    let mut logits = Vec::new();
    for &t in &tokens[p..] {
        logits.push(model.forward(&mut s, &[t], LogitsFor::Last).unwrap());
        states.push(s.clone());
    }
    (states, logits)
}

#[test]
fn chain_rollback_equals_decoding_only_the_kept_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let meta = json(&root().join("tests/fixtures/golden_mtp/hc4_mtp/golden.json"));
    let tokens = ids(&meta["token_ids"]);
    for (name, model) in [
        ("hc4_mtp", reference_mtp_model(tmp.path())),
        ("ple_eos", golden_with_random_mtp("ple_eos", tmp.path())),
        ("qsa_budget", golden_with_random_mtp("qsa_budget", tmp.path())),
    ] {
        let vocab = model.config.vocab;
        let toks: Vec<u32> = tokens.iter().map(|&t| t % vocab as u32).collect();
        // The sequence crosses EOS tokens (PLE segments) and, for qsa_budget, the indexer's block selection.
        let p = 30;
        let chain = &toks[p..p + 9];
        let (states, step_logits) = plain_states(&model, &toks[..p + 9], p, 64);
        for keep in 0..=chain.len() {
            let mut s = states[0].clone();
            let out = model.forward_chain(&mut s, chain).unwrap();
            for (i, row) in out.logits.chunks_exact(vocab).enumerate() {
                assert!(row == step_logits[i].as_slice(), "{name}: chain row {i} differs from the plain step");
            }
            model.rollback_chain(&mut s, &out.record, keep).unwrap();
            assert!(
                s == states[keep],
                "{name}: rollback to {keep} of {} rows differs from plain decoding",
                chain.len()
            );
            // And decoding goes on identically from there, and as from a fresh prefill of the same tokens (one
            // forward with the chunked Gated DeltaNet: equal up to rounding).
            if keep < chain.len() {
                let a = model.forward(&mut s, &chain[keep..keep + 1], LogitsFor::Last).unwrap();
                assert!(a == step_logits[keep], "{name}: the step after rollback {keep} differs");
                let mut fresh = model.new_state(64);
                let b = model.forward(&mut fresh, &toks[..p + keep + 1], LogitsFor::Last).unwrap();
                let (rel, differ) = compare(&a, &b, vocab);
                assert!(rel < 1e-4 && differ.is_empty(), "{name}: vs a fresh prefill after rollback {keep}: {rel:.2e}");
                assert_eq!(fresh.pos, s.pos);
            }
        }
        // A chain that is not the state's last cannot be rolled back.
        let mut s = states[0].clone();
        let out = model.forward_chain(&mut s, chain).unwrap();
        model.forward(&mut s, &[1], LogitsFor::None).unwrap();
        assert!(model.rollback_chain(&mut s, &out.record, 2).is_err());
    }
}

/// Largest difference between two states' numbers (every cache and recurrent state, MTP included), relative to
/// the largest magnitude; `None` when their shapes differ.
fn state_distance(a: &SequenceState, b: &SequenceState) -> Option<f32> {
    use nebula_engine::model::state::LayerState;
    let mut pairs: Vec<(&[f32], &[f32])> = Vec::new();
    for (x, y) in a.layers.iter().zip(&b.layers) {
        match (x, y) {
            (LayerState::LinearAttention(p), LayerState::LinearAttention(q)) => {
                pairs.push((&p.conv, &q.conv));
                pairs.push((&p.recurrent, &q.recurrent));
            }
            (LayerState::Attention(p), LayerState::Attention(q)) => {
                for (x, y) in [(&p.k, &q.k), (&p.v, &q.v), (&p.index_k, &q.index_k), (&p.pooled, &q.pooled)] {
                    pairs.push((x.as_f32().expect("f32 caches"), y.as_f32().expect("f32 caches")));
                }
            }
            _ => return None,
        }
    }
    match (&a.ple, &b.ple) {
        (Some(p), Some(q)) if p.context == q.context => pairs.push((&p.conv, &q.conv)),
        (None, None) => {}
        _ => return None,
    }
    match (&a.mtp, &b.mtp) {
        (Some(p), Some(q)) => {
            for (x, y) in [(&p.attn.k, &q.attn.k), (&p.attn.v, &q.attn.v)] {
                pairs.push((x.as_f32().expect("f32 caches"), y.as_f32().expect("f32 caches")));
            }
            pairs.push((&p.last_bank, &q.last_bank));
        }
        (None, None) => {}
        _ => return None,
    }
    let mut worst = 0f32;
    for (x, y) in pairs {
        if x.len() != y.len() {
            return None;
        }
        let scale = y.iter().fold(1f32, |m, v| m.max(v.abs()));
        worst = worst.max(x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs())) / scale);
    }
    (a.pos == b.pos).then_some(worst)
}

/// A sink that collects greedy output and, when given plain-decoding states, checks the state after every step or
/// chain against them (bit for bit) and against a fresh prefill of the same tokens (up to rounding).
struct Collect<'a> {
    out: Vec<u32>,
    max: usize,
    /// What `needs_logits` answers (false: plain greedy steps may choose on the model's side).
    needs: bool,
    states: Option<(&'a [SequenceState], usize)>,
    fresh: Option<(&'a Qwen4Exp, &'a [u32])>,
    checked: usize,
}

impl<M: Backend<State = SequenceState>> TokenSink<M> for Collect<'_> {
    fn mask(&mut self, _logits: &mut [f32]) -> Result<(), String> {
        Ok(())
    }
    fn commit(&mut self, token: u32, _logits: &[f32], room: bool) -> Result<Flow, String> {
        self.out.push(token);
        Ok(if self.out.len() >= self.max || !room { Flow::Finish(FinishReason::Length) } else { Flow::Continue })
    }
    fn remaining(&self) -> usize {
        self.max - self.out.len()
    }
    fn needs_logits(&self) -> bool {
        self.needs
    }
    fn consumed(&mut self, _model: &M, state: &SequenceState) {
        if let Some((states, p)) = self.states {
            let want = &states[state.pos - p];
            assert!(state == want, "state at position {} differs from plain decoding", state.pos);
            self.checked += 1;
        }
        if let Some((model, tokens)) = self.fresh {
            let mut fresh = model.new_state(state.max_len);
            model.forward(&mut fresh, &tokens[..state.pos], LogitsFor::None).unwrap();
            let d = state_distance(state, &fresh).expect("same shapes");
            assert!(d < 1e-4, "state at {} vs a fresh prefill: {d:.2e}", state.pos);
        }
    }
}

/// Greedy decoding of `n` tokens after `prompt` with `model` (drafting on or off).
fn greedy<M: Backend<State = SequenceState>>(
    model: &M,
    state: SequenceState,
    logits: Vec<f32>,
    n: usize,
    opts: SpeculativeOptions,
    states: Option<(&[SequenceState], usize)>,
    fresh: Option<(&Qwen4Exp, &[u32])>,
) -> (Vec<u32>, nebula_engine::speculative::stats::DecodeReport, usize) {
    let mut state = state;
    let limit = state.max_len;
    let mut sampler = Sampler::new(SamplingParams::GREEDY);
    let mut sink = Collect { out: Vec::new(), max: n, needs: true, states, fresh, checked: 0 };
    let mut dec = SpeculativeDecoder::new(model, opts, None);
    dec.run(&mut state, logits, &mut sampler, &mut sink, limit).unwrap();
    (sink.out, dec.report, sink.checked)
}

/// The CPU model seen through [`Backend`], counting the plain steps that chose their token on the model's side
/// ([`Backend::step_greedy`]).
struct CountGreedy<'a> {
    model: &'a Qwen4Exp,
    greedy_steps: std::cell::Cell<usize>,
}

/// The CPU model's state operations, delegated to the wrapped model (`$inner`), for test wrappers that change
/// only how they draft or step.
macro_rules! delegate_cpu_state {
    ($inner:tt) => {
        fn config(&self) -> &nebula_engine::model::ModelConfig {
            &self.$inner.config
        }
        fn describe(&self) -> String {
            Backend::describe(self.$inner)
        }
        fn has_mtp(&self) -> bool {
            true
        }
        fn capacity(&self, state: &SequenceState) -> usize {
            Backend::capacity(self.$inner, state)
        }
        fn state_bytes(&self, max_len: usize, drafting: bool) -> nebula_engine::backend::HeldBytes {
            Backend::state_bytes(self.$inner, max_len, drafting)
        }
        fn new_state(&self, max_len: usize, drafting: bool) -> Result<SequenceState, BackendError> {
            Backend::new_state(self.$inner, max_len, drafting)
        }
        fn position(&self, state: &SequenceState) -> usize {
            state.pos
        }
        fn forward(&self, s: &mut SequenceState, t: &[u32], want: LogitsFor) -> Result<Vec<f32>, BackendError> {
            Backend::forward(self.$inner, s, t, want)
        }
        fn snapshot(&self, state: &SequenceState) -> Result<Snapshot, BackendError> {
            Backend::snapshot(self.$inner, state)
        }
        fn restore(&self, state: &mut SequenceState, snap: &Snapshot) -> Result<(), BackendError> {
            Backend::restore(self.$inner, state, snap)
        }
        fn fork(
            &self,
            source: &Kept<SequenceState>,
            snap: &Snapshot,
            max_len: usize,
            drafting: bool,
        ) -> Result<SequenceState, BackendError> {
            Backend::fork(self.$inner, source, snap, max_len, drafting)
        }
        fn state_held(&self, state: &SequenceState) -> HeldBytes {
            Backend::state_held(self.$inner, state)
        }
        fn spill_state(&self, state: &SequenceState) -> Result<SequenceState, BackendError> {
            Backend::spill_state(self.$inner, state)
        }
        fn snapshot_image(&self, snap: &Snapshot) -> Result<Snapshot, BackendError> {
            Backend::snapshot_image(self.$inner, snap)
        }
        fn snapshot_from_image(&self, image: Snapshot) -> Snapshot {
            image
        }
        fn placement_stats(&self) -> Option<std::sync::Arc<nebula_engine::placement::PlacementStats>> {
            Backend::placement_stats(self.$inner)
        }
    };
}

impl Backend for CountGreedy<'_> {
    type State = SequenceState;
    type Snapshot = Snapshot;
    type Record = <Qwen4Exp as Backend>::Record;
    delegate_cpu_state!(model);
    fn step(&self, state: &mut SequenceState, token: u32) -> Result<Vec<f32>, BackendError> {
        Backend::step(self.model, state, token)
    }
    fn step_greedy(&self, state: &mut SequenceState, token: u32) -> Result<Option<u32>, BackendError> {
        self.greedy_steps.set(self.greedy_steps.get() + 1);
        Backend::step_greedy(self.model, state, token)
    }
    fn can_draft(&self, state: &SequenceState) -> bool {
        Backend::can_draft(self.model, state)
    }
    fn draft(&self, state: &mut SequenceState, pending: u32, n: usize) -> Result<Vec<u32>, BackendError> {
        Backend::draft(self.model, state, pending, n)
    }
    fn verify(
        &self,
        state: &mut SequenceState,
        chain: &[u32],
    ) -> Result<nebula_engine::speculative::Verified<Self::Record>, BackendError> {
        Backend::verify(self.model, state, chain)
    }
    fn rollback(
        &self,
        state: &mut SequenceState,
        record: &Self::Record,
        keep: usize,
    ) -> Result<nebula_engine::speculative::Rollback, BackendError> {
        Backend::rollback(self.model, state, record, keep)
    }
}

/// Plain greedy decoding with a sink that reads no logits takes the decoder's fast path (the model chooses the
/// token: on a GPU, without copying the logits back) and emits exactly the tokens of the ordinary path, with MTP
/// off and on (level 3's plain steps after a collapse).
#[test]
fn greedy_steps_without_logits_emit_the_same_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let model = golden_with_random_mtp("hc4_moe", tmp.path());
    let g = json(&root().join("tests/fixtures/golden/hc4_moe/golden.json"));
    let prompt = &ids(&g["token_ids"])[..24];
    let n = 120;
    let mut s = model.new_state(prompt.len() + n + 1);
    let logits = model.forward(&mut s, prompt, LogitsFor::Last).unwrap();
    let off = SpeculativeOptions { enabled: false, ..Default::default() };
    let (reference, _, _) = greedy(&model, s.clone(), logits.clone(), n, off, None, None);
    for opts in [off, SpeculativeOptions::default()] {
        let counted = CountGreedy { model: &model, greedy_steps: std::cell::Cell::new(0) };
        let mut state = s.clone();
        let mut sampler = Sampler::new(SamplingParams::GREEDY);
        let mut sink = Collect { out: Vec::new(), max: n, needs: false, states: None, fresh: None, checked: 0 };
        let mut dec = SpeculativeDecoder::new(&counted, opts, None);
        let limit = state.max_len;
        dec.run(&mut state, logits.clone(), &mut sampler, &mut sink, limit).unwrap();
        assert_eq!(sink.out, reference, "drafting {}: the fast path's tokens differ", opts.enabled);
        assert_eq!(
            counted.greedy_steps.get(),
            dec.report.plain_steps,
            "drafting {}: every plain step takes the fast path",
            opts.enabled
        );
        assert!(dec.report.plain_steps > 0);
        // A sampler with a penalty reads the logits: no fast path.
        let counted = CountGreedy { model: &model, greedy_steps: std::cell::Cell::new(0) };
        let mut state = s.clone();
        let mut sampler = Sampler::new(SamplingParams { presence_penalty: 0.5, ..SamplingParams::GREEDY });
        let mut sink = Collect { out: Vec::new(), max: 8, needs: false, states: None, fresh: None, checked: 0 };
        let mut dec = SpeculativeDecoder::new(&counted, opts, None);
        let limit = state.max_len;
        dec.run(&mut state, logits.clone(), &mut sampler, &mut sink, limit).unwrap();
        assert_eq!(counted.greedy_steps.get(), 0, "a penalised sampler must see the logits");
    }
}

#[test]
fn level_3_with_mtp_equals_plain_greedy_on_every_golden_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let mut models = vec![("hc4_mtp".to_string(), reference_mtp_model(tmp.path()))];
    for name in ["hc4_moe", "qsa_budget", "ple_eos", "wide256"] {
        models.push((name.to_string(), golden_with_random_mtp(name, tmp.path())));
    }
    for (name, model) in &models {
        let g = json(
            &root()
                .join("tests/fixtures/golden")
                .join(if name == "hc4_mtp" { "hc4_moe" } else { name })
                .join("golden.json"),
        );
        let prompt = &ids(&g["token_ids"])[..24];
        let n = 300;
        let mut s = model.new_state(prompt.len() + n + 1);
        let logits = model.forward(&mut s, prompt, LogitsFor::Last).unwrap();
        let off = SpeculativeOptions { enabled: false, ..Default::default() };
        let (plain, _, _) = greedy(model, s.clone(), logits.clone(), n, off, None, None);
        let (spec, report, _) = greedy(model, s, logits, n, SpeculativeOptions::default(), None, None);
        println!(
            "{name}: {} tokens, {} drafts, {} accepted, chains A/B/C {:?}, {} plain steps, collapses {}",
            spec.len(),
            report.drafted,
            report.accepted,
            report.chains,
            report.plain_steps,
            report.collapses
        );
        assert_eq!(spec.len(), n);
        assert_eq!(spec, plain, "{name}: level 3 output differs from plain greedy decoding");
        assert!(report.drafted > 0, "{name}: MTP drafted");
    }
}

#[test]
fn scripted_drafter_drives_every_case_with_exact_states() {
    let tmp = tempfile::tempdir().unwrap();
    let model = reference_mtp_model(tmp.path());
    let meta = json(&root().join("tests/fixtures/golden/hc4_moe/golden.json"));
    let prompt = ids(&meta["token_ids"])[..20].to_vec();
    let p = prompt.len();
    let n = 160;
    // The truth: plain greedy output, and the plain-decoding state at every position.
    let mut s0 = model.new_state(p + n + 1);
    let logits0 = model.forward(&mut s0, &prompt, LogitsFor::Last).unwrap();
    let off = SpeculativeOptions { enabled: false, ..Default::default() };
    let (truth, _, _) = greedy(&model, s0.clone(), logits0.clone(), n, off, None, None);
    let mut reference = prompt.clone();
    reference.extend_from_slice(&truth);
    let (states, _) = plain_states(&model, &reference, p, p + n + 1);

    let t = true;
    let f = false;
    let mut script: VecDeque<Vec<bool>> = VecDeque::from(vec![
        vec![t, t, t, t],       // 1: A, window 4 -> 4 (+0)
        vec![t, t, t, t],       // 2: A -> 5 (+1)
        vec![t, t, t, t, t],    // 3: A -> 6 (+1)
        vec![t, t, f, t, t, t], // 4: C after 2 accepted -> 4 (-2)
        vec![f, t, t, t],       // 5: C, first draft rejected -> 4
        vec![t, t, t, t],       // 6: A -> 4
        vec![t, t, t, t],       // 7: A -> 5
        vec![t, t, t, t, t],    // 8: A (the coverage plan makes chain 8 case B instead, see below)
    ]);
    // Then every first draft wrong until the controller collapses, the cooldown, and all right afterwards.
    for _ in 0..8 {
        script.push_back(vec![f; 16]);
    }
    let drafter = ScriptedDrafter::new(&model, reference.clone(), DraftPlan::Script(script), false)
        .with_coverage(Box::new(|chain, row, _pos| if chain == 7 && row == 2 { 0.5 } else { 1.0 }));
    let costs = FixedCosts {
        draft_per_token: 0.001,
        verify_base: 0.010,
        verify_per_row: 0.001,
        save: 0.0005,
        restore: 0.0005,
        realign: 0.0002,
    };
    let opts = SpeculativeOptions { fixed_costs: Some(costs), ..Default::default() };
    let (out, report, checked) = greedy(&drafter, s0, logits0, n, opts, Some((&states, p)), Some((&model, &reference)));
    let log = drafter.log();
    let windows: Vec<usize> = log.iter().map(|c| c.tokens.len()).collect();
    println!("windows {windows:?}");
    println!("{report:?}");
    assert_eq!(out, truth, "level 3 output equals plain greedy decoding");
    assert_eq!(&windows[..8], &[4, 4, 5, 6, 4, 4, 4, 5], "growth, shrink and first-token reset");
    assert!(report.chains[0] >= 5, "case A chains: {:?}", report.chains);
    assert_eq!(report.chains[1], 1, "one case B chain");
    assert!(report.chains[2] >= 3, "case C chains: {:?}", report.chains);
    assert!(report.first_rejected >= 2);
    assert_eq!(report.collapses, 1, "one collapse");
    assert_eq!(report.recoveries, 1, "drafting came back");
    assert!(report.plain_steps >= 32, "the cooldown decoded plainly: {} plain steps", report.plain_steps);
    assert!(
        log.iter().skip(8).any(|c| !c.right.is_empty() && c.right.iter().all(|&r| r)),
        "right chains after recovery"
    );
    // Chain 8 was cut at its row 2 by low coverage: 2 drafts accepted, the exact step produced the third token.
    assert_eq!(log[7].tokens.len(), 5);
    assert!(checked > log.len(), "every chain and step was checked against plain decoding ({checked} checks)");
}

/// Runs `req` on `engine`; returns the tokens and the usage.
fn run_engine(
    engine: &nebula_engine::worker::Engine,
    req: nebula_engine::worker::GenerateRequest,
) -> (Vec<u32>, FinishReason, nebula_engine::worker::Usage) {
    use nebula_engine::worker::GenerationEvent;
    let mut rx = engine.submit(req).unwrap();
    let mut out = Vec::new();
    loop {
        match rx.blocking_recv().expect("the worker reports an end") {
            GenerationEvent::Token { id, .. } => out.push(id),
            GenerationEvent::Finished { reason, usage } => return (out, reason, usage),
            GenerationEvent::Failed(e) => panic!("generation failed: {e}"),
            _ => {}
        }
    }
}

/// The demo model (its GGUF has no MTP block; a random one is appended): through the engine, level 3 with MTP
/// reproduces the reference answers and long greedy outputs token for token, and the engine reports its drafts.
#[test]
fn demo_model_with_mtp_decodes_exactly_as_without() {
    use nebula_engine::text::chat_template::RenderRequest;
    use nebula_engine::worker::{Engine, EngineOptions, GenerateRequest};
    let tmp = tempfile::tempdir().unwrap();
    let with = tmp.path().join("demo-mtp.gguf");
    append_random_mtp(&root().join("models/nebula-demo.gguf"), &with, 11).unwrap();
    let opts = EngineOptions { prefix_cache: Default::default(), ..Default::default() };
    let engine = Engine::load(&with, opts).unwrap();
    assert!(engine.has_mtp());
    let fixture = json(&root().join("tests/fixtures/demo/reference_greedy.json"));
    let template = engine.chat_template().unwrap();
    for case in fixture["cases"].as_array().unwrap() {
        let messages = serde_json::json!([{"role": "user", "content": case["user"]}]);
        let mut req = RenderRequest::new(&messages);
        req.add_generation_prompt = true;
        let ids = engine.tokenizer().encode(&template.render(&req).unwrap()).unwrap();
        let (out, reason, usage) = run_engine(&engine, GenerateRequest::new(ids.clone(), 80));
        let text = engine.tokenizer().decode(&out, false).unwrap();
        assert_eq!(reason, FinishReason::Stop);
        assert_eq!(format!("{text}<|im_end|>"), case["completion"].as_str().unwrap());
        assert!(usage.draft_tokens > 0, "the engine drafted");

        // A long output past the end of turn: MTP on and off give the same tokens.
        let mut long = GenerateRequest::new(ids, 200);
        long.ignore_eos = true;
        long.use_prefix_cache = false;
        let (spec, _, usage) = run_engine(&engine, long.clone());
        long.speculative = false;
        let (plain, _, plain_usage) = run_engine(&engine, long);
        assert_eq!(spec.len(), 200);
        assert_eq!(spec, plain, "level 3 with MTP differs from plain greedy on the demo model");
        assert!(usage.draft_tokens > 0 && plain_usage.draft_tokens == 0);
    }
    let s = &engine.stats().speculative;
    assert!(s.drafted.load(std::sync::atomic::Ordering::Relaxed) > 0);
    // Server switch off: the block is not loaded and nothing drafts.
    let off = Engine::load(&with, EngineOptions { mtp: false, ..Default::default() }).unwrap();
    assert!(!off.has_mtp());
    let (_, _, usage) = run_engine(&off, GenerateRequest::new(vec![248045, 846, 198], 8));
    assert_eq!(usage.draft_tokens, 0);

    // The prefix cache carries the MTP cache: a follow-up that resumes from a cached answer drafts at once and
    // still decodes exactly as without MTP.
    let first: Vec<u32> = vec![248045, 846, 198, 9707, 0, 248046, 198, 248045, 77091, 198];
    let mut a = GenerateRequest::new(first.clone(), 48);
    a.ignore_eos = true;
    let (out_a, _, _) = run_engine(&engine, a);
    let mut follow = first.clone();
    follow.extend_from_slice(&out_a);
    follow.extend_from_slice(&[248046, 198, 248045, 846, 198]);
    let mut b = GenerateRequest::new(follow, 64);
    b.ignore_eos = true;
    let (out_b, _, usage_b) = run_engine(&engine, b.clone());
    assert!(usage_b.cached_tokens > first.len(), "resumed from the cached answer: {usage_b:?}");
    assert!(usage_b.draft_tokens > 0, "drafting works on a resumed state");
    b.use_prefix_cache = false;
    let (want_b, _, _) = run_engine(&off, b);
    assert_eq!(out_b, want_b, "a resumed request with MTP decodes as plain decoding");
}

/// A drafter that always proposes the target's second most likely token (computed by plain steps on a copy of
/// the state), so relaxed levels have near-greedy drafts to accept.
struct SecondBest<'a>(&'a Qwen4Exp);

impl Backend for SecondBest<'_> {
    type State = SequenceState;
    type Snapshot = Snapshot;
    type Record = nebula_engine::model::ChainRecord;
    delegate_cpu_state!(0);
    fn can_draft(&self, _s: &SequenceState) -> bool {
        true
    }
    fn draft(&self, s: &mut SequenceState, pending: u32, n: usize) -> Result<Vec<u32>, BackendError> {
        let mut copy = s.clone();
        let mut tok = pending;
        let mut out = Vec::new();
        for _ in 0..n.min(copy.max_len - copy.pos) {
            let l = self.0.forward(&mut copy, &[tok], LogitsFor::Last)?;
            let mut order: Vec<usize> = (0..l.len()).collect();
            order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
            tok = order[1] as u32;
            out.push(tok);
        }
        Ok(out)
    }
    fn verify(
        &self,
        s: &mut SequenceState,
        chain: &[u32],
    ) -> Result<nebula_engine::speculative::Verified<Self::Record>, BackendError> {
        Backend::verify(self.0, s, chain)
    }
    fn rollback(
        &self,
        s: &mut SequenceState,
        r: &Self::Record,
        keep: usize,
    ) -> Result<nebula_engine::speculative::Rollback, BackendError> {
        Backend::rollback(self.0, s, r, keep)
    }
}

/// Checks every emitted token against the level's rule on the row's own logits.
struct RuleSink {
    out: Vec<u32>,
    max: usize,
    rule: nebula_engine::speculative::verify::RelaxedRule,
    non_greedy: usize,
}

impl<M: Backend<State = SequenceState>> TokenSink<M> for RuleSink {
    fn mask(&mut self, _logits: &mut [f32]) -> Result<(), String> {
        Ok(())
    }
    fn commit(&mut self, token: u32, logits: &[f32], room: bool) -> Result<Flow, String> {
        let top = argmax(logits).unwrap();
        if token as usize != top {
            let l = logits[token as usize];
            let rank = logits.iter().enumerate().filter(|&(j, &v)| v > l || (v == l && j < token as usize)).count();
            let ratio = (l - logits[top]).exp();
            assert!(rank < self.rule.top_k && ratio >= self.rule.min_ratio, "token rank {rank} ratio {ratio}");
            self.non_greedy += 1;
        }
        self.out.push(token);
        Ok(if self.out.len() >= self.max || !room { Flow::Finish(FinishReason::Length) } else { Flow::Continue })
    }
    fn remaining(&self) -> usize {
        self.max - self.out.len()
    }
}

/// Levels 2 and 1 end to end: every output token is the target's greedy one or satisfies the level's rule, and
/// no chain accepts more non-greedy drafts than the level allows.
#[test]
fn relaxed_levels_accept_only_what_their_rules_allow() {
    use nebula_engine::speculative::AccuracyLevel;
    let tmp = tempfile::tempdir().unwrap();
    let model = golden_with_random_mtp("ple_eos", tmp.path());
    let prompt = &ids(&json(&root().join("tests/fixtures/golden/ple_eos/golden.json"))["token_ids"])[..16];
    for level in [AccuracyLevel::Balanced, AccuracyLevel::Relaxed] {
        let rule = level.relaxed_rule().unwrap();
        let n = 120;
        let mut s = model.new_state(prompt.len() + n + 1);
        let logits = model.forward(&mut s, prompt, LogitsFor::Last).unwrap();
        let mut sink = RuleSink { out: Vec::new(), max: n, rule, non_greedy: 0 };
        let mut sampler = Sampler::new(SamplingParams::GREEDY);
        let drafter = SecondBest(&model);
        let opts = SpeculativeOptions { level, ..Default::default() };
        let mut dec = SpeculativeDecoder::new(&drafter, opts, None);
        let limit = s.max_len;
        dec.run(&mut s, logits, &mut sampler, &mut sink, limit).unwrap();
        let chains = dec.report.total_chains();
        println!("{level:?}: {} non-greedy tokens over {chains} chains", sink.non_greedy);
        assert_eq!(sink.out.len(), n);
        assert!(sink.non_greedy > 0, "{level:?}: some second-best drafts qualified");
        assert!(sink.non_greedy <= rule.max_per_chain * chains, "{level:?}: over the per-chain budget");
        assert!(dec.report.accepted >= sink.non_greedy);
    }
}

/// `nebula bench mtp`'s engine part runs every row on a small model; its level-3 and scripted rows must decode
/// exactly as plain decoding (the benchmark refuses otherwise) and the scripted rates come out near their targets.
#[test]
fn bench_mtp_runs_and_scripted_rates_hold() {
    use nebula_engine::speculative::bench::{MtpBenchOptions, run_mtp_bench};
    let tmp = tempfile::tempdir().unwrap();
    let model = reference_mtp_model(tmp.path());
    let opts = MtpBenchOptions { prompt_tokens: 16, decode_tokens: 64, rates: vec![0.9], ..Default::default() };
    let rows = run_mtp_bench(&model, &opts, |_| {}).unwrap();
    let labels: Vec<&str> = rows.iter().map(|r| r.label.as_str()).collect();
    assert_eq!(labels, ["off", "mtp L3", "mtp L2", "mtp L1", "mtp T=0.7", "rate 0.90 +mtp", "rate 0.90 free"]);
    for r in &rows {
        assert_eq!(r.tokens, 64, "{}", r.label);
        assert!(r.tok_s > 0.0);
    }
    let free = &rows[6].report;
    assert!(free.acceptance_rate() > 0.4 && free.mean_accepted_length() > 2.0, "{free:?}");
}
