//! Continuous batching on the CPU, on the embedded demo model: a request's output does not depend on what else
//! runs beside it (bit-identical log-probabilities, so bit-identical logits at the reported tokens), `n` choices
//! equal the same seeded requests alone, a cancelled or failing sequence leaves the others unchanged, a
//! prefix-cache resume inside a batch equals a cold run, chunked prefill runs beside decoding within the token
//! budget, and admission keeps to the state budget.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use nebula_engine::backend::{Backend, BatchItem, BatchMode};
use nebula_engine::model::{LogitsFor, Qwen4Exp};
use nebula_engine::sampling::{SamplingParams, TokenConstraint, TokenLogprobs};
use nebula_engine::worker::{
    BatchOptions, ConstraintHandle, Engine, EngineOptions, FinishReason, GenerateRequest, GenerationError,
    GenerationEvent, StepObserver, StepReport, SubmitError,
};
use tokio::sync::mpsc::UnboundedReceiver;

fn demo_path() -> std::path::PathBuf {
    nebula_tests::repo_root().join("models/nebula-demo.gguf")
}

/// Every batched pass the engine ran.
#[derive(Default, Clone)]
struct Passes(Arc<Mutex<Vec<StepReport>>>);

impl Passes {
    fn observer(&self) -> StepObserver {
        let log = self.0.clone();
        StepObserver(Arc::new(move |r: &StepReport| log.lock().unwrap().push(*r)))
    }
    fn take(&self) -> Vec<StepReport> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

fn engine_with(batch: BatchOptions, passes: &Passes) -> Engine {
    let opts = EngineOptions { batch, step_observer: Some(passes.observer()), ..Default::default() };
    Engine::load(&demo_path(), opts).expect("the demo model loads")
}

/// Distinct chat prompts of different lengths.
fn prompts(engine: &Engine, n: usize) -> Vec<Vec<u32>> {
    let topics = ["the sea", "a cat", "rain", "coffee", "stars", "a bridge", "the moon", "bread"];
    (0..n)
        .map(|i| {
            let text = format!("Tell me about {} in {} words.", topics[i % topics.len()], 5 + 3 * i);
            nebula_tests::chat_prompt(engine, serde_json::json!([{"role": "user", "content": text}]))
        })
        .collect()
}

/// A greedy request with log-probabilities, the prefix cache off, no drafting.
fn request(prompt: &[u32], max_tokens: usize) -> GenerateRequest {
    let mut req = GenerateRequest::new(prompt.to_vec(), max_tokens);
    req.logprobs = Some(3);
    req.use_prefix_cache = false;
    req.speculative = false;
    req.ignore_eos = true;
    req
}

/// What a request produced.
#[derive(Debug, Clone, PartialEq)]
struct Output {
    tokens: Vec<u32>,
    logprobs: Vec<Option<TokenLogprobs>>,
    finish: Result<FinishReason, GenerationError>,
}

fn collect(mut rx: UnboundedReceiver<GenerationEvent>) -> Output {
    let mut out = Output { tokens: Vec::new(), logprobs: Vec::new(), finish: Ok(FinishReason::Stop) };
    loop {
        match rx.blocking_recv().expect("the worker reports an end") {
            GenerationEvent::Token { id, logprobs } => {
                out.tokens.push(id);
                out.logprobs.push(logprobs);
            }
            GenerationEvent::Finished { reason, .. } => {
                out.finish = Ok(reason);
                return out;
            }
            GenerationEvent::Failed(e) => {
                out.finish = Err(e);
                return out;
            }
            GenerationEvent::Started { .. } | GenerationEvent::Prefilled { .. } => {}
        }
    }
}

/// Runs `reqs` at once (submitted together) and collects each.
fn run_together(engine: &Engine, reqs: Vec<GenerateRequest>) -> Vec<Output> {
    let rxs: Vec<_> = reqs.into_iter().map(|r| engine.submit(r).expect("submits")).collect();
    rxs.into_iter().map(collect).collect()
}

#[test]
fn a_sequence_decodes_the_same_alone_and_among_1_3_and_15_others() {
    let passes = Passes::default();
    let engine = engine_with(BatchOptions { max_sequences: 16, ..Default::default() }, &passes);
    let prompts = prompts(&engine, 16);
    let alone: Vec<Output> = prompts.iter().map(|p| run_together(&engine, vec![request(p, 20)]).remove(0)).collect();
    assert!(passes.take().iter().all(|p| p.sequences == 1), "alone, every pass holds one sequence");
    for out in &alone {
        assert_eq!(out.finish, Ok(FinishReason::Length));
        assert_eq!(out.tokens.len(), 20);
    }
    for size in [2, 4, 16] {
        for group in prompts.chunks(size).zip(alone.chunks(size)) {
            let (ps, want) = group;
            let got = run_together(&engine, ps.iter().map(|p| request(p, 20)).collect());
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                assert_eq!(g, w, "batch of {size}, member {i}: tokens and log-probabilities differ from alone");
            }
        }
        let seen = passes.take();
        let widest = seen.iter().map(|p| p.sequences).max().unwrap_or(0);
        assert_eq!(widest, size, "batches of {size} ran in passes of {widest} sequences at most");
        assert!(seen.iter().any(|p| p.decode_rows == size), "{size} sequences decoded in one pass");
    }
}

#[test]
fn forward_batch_equals_each_call_alone_bit_for_bit() {
    let model = Qwen4Exp::load(&demo_path()).unwrap();
    let engine = engine_with(BatchOptions::default(), &Passes::default());
    let ps = prompts(&engine, 4);
    // Item 0 prefills a chunk from its start, items 1-3 decode a token after a prefix of their prompt.
    let mut states: Vec<_> = (0..4).map(|_| model.new_state(256)).collect();
    let mut alone_states: Vec<_> = (0..4).map(|_| model.new_state(256)).collect();
    for i in 1..4 {
        let n = ps[i].len() - 1;
        model.forward(&mut states[i], &ps[i][..n], LogitsFor::None).unwrap();
        model.forward(&mut alone_states[i], &ps[i][..n], LogitsFor::None).unwrap();
    }
    let tokens: Vec<&[u32]> =
        vec![&ps[0][..], &ps[1][ps[1].len() - 1..], &ps[2][ps[2].len() - 1..], &ps[3][ps[3].len() - 1..]];
    let wants = [LogitsFor::All, LogitsFor::Last, LogitsFor::Last, LogitsFor::Last];
    let got = {
        let mut items: Vec<BatchItem<'_, _>> = states
            .iter_mut()
            .zip(&tokens)
            .zip(wants)
            .map(|((state, t), want)| BatchItem::text(state, t, want))
            .collect();
        model.forward_batch(&mut items, BatchMode::Fast).unwrap()
    };
    for i in 0..4 {
        let want = Backend::forward(&model, &mut alone_states[i], tokens[i], wants[i]).unwrap();
        assert_eq!(got[i].len(), want.len(), "item {i}: logits shape");
        assert!(
            got[i].iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
            "item {i}: logits differ from alone"
        );
        assert_eq!(states[i], alone_states[i], "item {i}: the state differs from alone");
    }
    // A bad token in one item fails the call before any state changes.
    let before = states.clone();
    let bad = [model.config.vocab as u32];
    let good = [1u32];
    let mut items: Vec<BatchItem<'_, _>> = states
        .iter_mut()
        .enumerate()
        .map(|(i, state)| BatchItem::text(state, if i == 2 { &bad[..] } else { &good[..] }, LogitsFor::Last))
        .collect();
    assert!(model.forward_batch(&mut items, BatchMode::Fast).is_err());
    drop(items);
    assert_eq!(states, before, "a refused batch changes no state");
}

#[test]
fn n_choices_equal_the_same_seeded_requests_alone() {
    let passes = Passes::default();
    let engine = engine_with(BatchOptions::default(), &passes);
    let prompt = &prompts(&engine, 1)[0];
    let choice = |seed: u64| {
        let mut req = request(prompt, 16);
        req.sampling = SamplingParams { temperature: 0.9, top_p: 0.95, seed: Some(seed), ..Default::default() };
        req
    };
    let alone: Vec<Output> = (0..4).map(|i| run_together(&engine, vec![choice(40 + i)]).remove(0)).collect();
    passes.take();
    let rxs = engine.submit_choices((0..4).map(|i| choice(40 + i)).collect()).expect("submits");
    let got: Vec<Output> = rxs.into_iter().map(collect).collect();
    assert_eq!(got, alone, "each choice equals the request with its seed alone");
    let seen = passes.take();
    let prefilled: usize = seen.iter().map(|p| p.tokens - p.decode_rows).sum();
    assert_eq!(prefilled, prompt.len(), "the prompt was prefilled once for the four choices");
    assert!(seen.iter().any(|p| p.decode_rows == 4), "the four choices decoded in one pass");
    assert!(alone.windows(2).any(|w| w[0].tokens != w[1].tokens), "different seeds gave different choices");
}

#[test]
fn a_cancelled_sequence_leaves_the_others_unchanged() {
    let engine = engine_with(BatchOptions::default(), &Passes::default());
    let ps = prompts(&engine, 4);
    let alone: Vec<Output> = ps.iter().map(|p| run_together(&engine, vec![request(p, 24)]).remove(0)).collect();
    let reqs: Vec<GenerateRequest> = ps.iter().map(|p| request(p, 24)).collect();
    let cancel = reqs[1].cancel.clone();
    let mut rxs: Vec<_> = reqs.into_iter().map(|r| engine.submit(r).unwrap()).collect();
    // Cancel the second after its third token.
    let mut seen = 0;
    let cancelled = loop {
        match rxs[1].blocking_recv().unwrap() {
            GenerationEvent::Token { .. } => {
                seen += 1;
                if seen == 3 {
                    cancel.store(true, Ordering::Relaxed);
                }
            }
            GenerationEvent::Finished { reason, .. } => break reason,
            GenerationEvent::Failed(e) => panic!("{e}"),
            _ => {}
        }
    };
    assert_eq!(cancelled, FinishReason::Cancelled);
    let second = rxs.remove(1);
    drop(second);
    let rest: Vec<Output> = rxs.into_iter().map(collect).collect();
    for (i, (g, w)) in rest.iter().zip([&alone[0], &alone[2], &alone[3]]).enumerate() {
        assert_eq!(g, w, "survivor {i} changed when a neighbour was cancelled");
    }
}

/// A constraint that refuses every token after `after` tokens: its request fails with a constraint error.
struct FailAfter {
    after: usize,
    seen: usize,
}

impl TokenConstraint for FailAfter {
    fn mask(&mut self, _logits: &mut [f32]) -> Result<(), String> {
        if self.seen >= self.after { Err("no token allowed here".into()) } else { Ok(()) }
    }
    fn commit(&mut self, _token: u32) -> Result<(), String> {
        self.seen += 1;
        Ok(())
    }
}

#[test]
fn a_failing_sequence_fails_alone_and_the_batch_goes_on() {
    let engine = engine_with(BatchOptions::default(), &Passes::default());
    let ps = prompts(&engine, 3);
    let alone: Vec<Output> = ps.iter().map(|p| run_together(&engine, vec![request(p, 16)]).remove(0)).collect();
    let mut reqs: Vec<GenerateRequest> = ps.iter().map(|p| request(p, 16)).collect();
    reqs[0].constraint = Some(ConstraintHandle::new(Box::new(FailAfter { after: 5, seen: 0 })));
    let got = run_together(&engine, reqs);
    assert!(matches!(&got[0].finish, Err(GenerationError::Constraint(_))), "{:?}", got[0].finish);
    assert_eq!(got[0].tokens, alone[0].tokens[..5].to_vec(), "the failing sequence's tokens until it failed");
    assert_eq!(&got[1..], &alone[1..], "the others are unchanged");
}

/// An engine whose prefix cache holds a first turn; returns it with the follow-up prompt that resumes from it.
fn warmed_engine() -> (Engine, Vec<u32>, usize) {
    let engine = engine_with(BatchOptions::default(), &Passes::default());
    let first = nebula_tests::chat_prompt(&engine, serde_json::json!([{"role": "user", "content": "Say hello."}]));
    let mut warm = GenerateRequest::new(first.clone(), 12);
    warm.speculative = false;
    let (answer, ..) = nebula_tests::run_request(&engine, warm);
    let text = engine.tokenizer().decode(&answer, true).unwrap();
    let follow = nebula_tests::chat_prompt(
        &engine,
        serde_json::json!([
            {"role": "user", "content": "Say hello."},
            {"role": "assistant", "content": text},
            {"role": "user", "content": "Again, please."}
        ]),
    );
    (engine, follow, first.len())
}

#[test]
fn a_prefix_cache_resume_inside_a_batch_equals_a_cold_run() {
    // Resumed alone and resumed among three others, on two engines warmed the same way: bit for bit equal; and
    // the same tokens as the cold run (a resume prefills from the checkpoint in other chunks, so its last bits
    // may differ from a prefill from the start).
    let (alone_engine, follow, first_len) = warmed_engine();
    let mut resumed = request(&follow, 16);
    resumed.use_prefix_cache = true;
    let alone = run_together(&alone_engine, vec![resumed.clone()]).remove(0);
    let cold = run_together(&alone_engine, vec![request(&follow, 16)]).remove(0);
    let (engine, follow2, _) = warmed_engine();
    assert_eq!(follow, follow2);
    let others = prompts(&engine, 3);
    let mut reqs = vec![resumed];
    reqs.extend(others.iter().map(|p| request(p, 16)));
    let mut rxs = reqs.into_iter().map(|r| engine.submit(r).unwrap());
    let mut first_rx = rxs.next().unwrap();
    let cached = match first_rx.blocking_recv().unwrap() {
        GenerationEvent::Started { cached_tokens } => cached_tokens,
        other => panic!("{other:?}"),
    };
    assert!(cached > first_len / 2, "the follow-up resumed from the cache ({cached} of {first_len} tokens)");
    let rest: Vec<_> = rxs.collect();
    let got = collect(first_rx);
    for rx in rest {
        assert_eq!(collect(rx).finish, Ok(FinishReason::Length));
    }
    assert_eq!(got, alone, "resumed inside a batch equals resumed alone, bit for bit");
    assert_eq!(got.tokens, cold.tokens, "resumed inside a batch gives the cold run's tokens");
}

#[test]
fn chunked_prefill_runs_beside_decoding_within_the_token_budget() {
    let passes = Passes::default();
    let batch = BatchOptions { max_sequences: 4, max_batch_tokens: Some(40), ..Default::default() };
    let engine = engine_with(batch, &passes);
    let short = &prompts(&engine, 1)[0];
    let long_text = "word ".repeat(300);
    let long = nebula_tests::chat_prompt(&engine, serde_json::json!([{"role": "user", "content": long_text}]));
    assert!(long.len() > 250);
    let decoding = engine.submit(request(short, 40)).unwrap();
    // Let the short one start decoding, then send the long prompt in chunks of 32.
    let mut rx = decoding;
    loop {
        if let GenerationEvent::Token { .. } = rx.blocking_recv().unwrap() {
            break;
        }
    }
    let mut long_req = request(&long, 4);
    long_req.prefill_chunk = Some(32);
    let long_rx = engine.submit(long_req).unwrap();
    let short_out = collect(rx);
    let long_out = collect(long_rx);
    assert_eq!(short_out.finish, Ok(FinishReason::Length));
    assert_eq!(long_out.finish, Ok(FinishReason::Length));
    let seen = passes.take();
    assert!(
        seen.iter().all(|p| p.tokens <= 40),
        "a pass over the token budget: {:?}",
        seen.iter().find(|p| p.tokens > 40)
    );
    let mixed = seen.iter().filter(|p| p.decode_rows >= 1 && p.tokens > p.decode_rows).count();
    assert!(mixed >= 5, "the long prompt's chunks ran beside the short one's decode rows ({mixed} passes)");
}

#[test]
fn admission_keeps_to_the_state_budget() {
    let model_cfg = Qwen4Exp::load(&demo_path()).unwrap().config.clone();
    let max_context = 512;
    let one = model_cfg.state_bytes(max_context.min(64 + 40), false);
    let passes = Passes::default();
    let opts = EngineOptions {
        max_context: Some(max_context),
        batch: BatchOptions { max_sequences: 8, state_budget: Some(one * 2 + one / 2), ..Default::default() },
        step_observer: Some(passes.observer()),
        ..Default::default()
    };
    let engine = Engine::load(&demo_path(), opts).unwrap();
    let ps = prompts(&engine, 5);
    let reqs: Vec<GenerateRequest> = ps
        .iter()
        .map(|p| {
            let mut r = request(p, 40);
            r.max_tokens = 40 + 64 - p.len().min(64);
            r
        })
        .collect();
    let outs = run_together(&engine, reqs);
    assert!(outs.iter().all(|o| o.finish == Ok(FinishReason::Length)), "every request ran to its end");
    let widest = passes.take().iter().map(|p| p.sequences).max().unwrap();
    assert!(widest <= 2, "at most two states fit the budget at once, {widest} ran");
    // A request that alone needs more than the budget is refused with the reason.
    let mut huge = request(&ps[0], 400);
    huge.max_tokens = 400;
    match engine.submit(huge) {
        Err(SubmitError::StateTooLarge { .. }) => {}
        other => panic!("expected StateTooLarge, got {:?}", other.map(|_| ())),
    }
    assert_eq!(engine.waiting(), 0);
}

#[test]
fn the_queue_limit_counts_waiting_requests() {
    let opts = EngineOptions {
        queue_capacity: 2,
        batch: BatchOptions { max_sequences: 1, ..Default::default() },
        ..Default::default()
    };
    let engine = Engine::load(&demo_path(), opts).unwrap();
    let p = &prompts(&engine, 1)[0];
    let running = engine.submit(request(p, 200)).unwrap();
    // Wait until it runs, so the next two wait in the queue.
    let mut running = running;
    while !matches!(running.blocking_recv().unwrap(), GenerationEvent::Token { .. }) {}
    let a = engine.submit(request(p, 2)).unwrap();
    let b = engine.submit(request(p, 2)).unwrap();
    assert!(matches!(engine.submit(request(p, 2)), Err(SubmitError::QueueFull(2))));
    drop(running);
    for rx in [a, b] {
        assert_eq!(collect(rx).finish, Ok(FinishReason::Length));
    }
}

#[test]
fn mtp_drafting_alone_and_plain_steps_in_a_batch_give_the_same_greedy_tokens() {
    // The demo model with a random MTP block: drafts are mostly rejected, but a sequence that drafts alone
    // (verified at the strict level) and one that takes plain steps in a batch must agree token for token.
    let tmp = tempfile::tempdir().unwrap();
    let with = tmp.path().join("demo-mtp.gguf");
    nebula_engine::synth::append_random_mtp(&demo_path(), &with, 7).unwrap();
    let passes = Passes::default();
    let opts = EngineOptions { step_observer: Some(passes.observer()), ..Default::default() };
    let engine = Engine::load(&with, opts).unwrap();
    assert!(engine.has_mtp());
    let ps = prompts(&engine, 4);
    let drafting = |p: &[u32]| {
        let mut r = request(p, 24);
        r.speculative = true;
        r.logprobs = None;
        r
    };
    let alone: Vec<Output> = ps.iter().map(|p| run_together(&engine, vec![drafting(p)]).remove(0)).collect();
    let drafted = engine.stats().speculative.drafted.load(Ordering::Relaxed);
    assert!(drafted > 0, "alone, the sequences drafted");
    passes.take();
    let together = run_together(&engine, ps.iter().map(|p| drafting(p)).collect());
    for (i, (g, w)) in together.iter().zip(&alone).enumerate() {
        assert_eq!(g.tokens, w.tokens, "sequence {i}: tokens differ between drafting alone and the batch");
    }
    assert!(passes.take().iter().any(|p| p.decode_rows == 4), "the four decoded in one pass");
}
