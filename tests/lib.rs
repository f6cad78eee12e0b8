//! Shared helpers for Nebula's cross-crate and end-to-end tests (the tests themselves are the `[[test]]`
//! targets of this crate).

use std::path::PathBuf;

/// The repository root: `NEBULA_REPO_ROOT` when set (test binaries carried to another machine), else the parent
/// of this crate's folder at build time.
pub fn repo_root() -> PathBuf {
    if let Ok(root) = std::env::var("NEBULA_REPO_ROOT") {
        return PathBuf::from(root);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// The golden `hc4_moe` trunk with the reference MTP block (`tests/fixtures/golden_mtp/hc4_mtp`, written by
/// `scripts/make_mtp_golden.py`), converted to an F32 GGUF in `tmp`; returns its path.
///
/// Panics: a fixture is missing or the conversion fails (test setup).
pub fn reference_mtp_gguf(tmp: &std::path::Path) -> PathBuf {
    use nebula_engine::convert::{ConvertOptions, OutType, convert};
    let ckpt = tmp.join("hc4_mtp");
    std::fs::create_dir_all(&ckpt).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(repo_root().join("tests/fixtures/golden/hc4_moe").join(f), ckpt.join(f)).unwrap();
    }
    std::fs::copy(repo_root().join("tests/fixtures/golden_mtp/hc4_mtp/mtp.safetensors"), ckpt.join("mtp.safetensors"))
        .unwrap();
    let out = tmp.join("hc4_mtp.gguf");
    let report = convert(&ckpt, &out, &ConvertOptions { out_type: OutType::F32, ..Default::default() }).unwrap();
    assert!(report.mtp);
    out
}

/// The golden checkpoint `name` converted to an F32 GGUF in `tmp` with a random MTP block appended; returns its
/// path.
///
/// Panics: as [`reference_mtp_gguf`].
pub fn golden_with_random_mtp_gguf(name: &str, tmp: &std::path::Path) -> PathBuf {
    use nebula_engine::convert::{ConvertOptions, OutType, convert};
    let plain = tmp.join(format!("{name}.gguf"));
    convert(
        &repo_root().join("tests/fixtures/golden").join(name),
        &plain,
        &ConvertOptions { out_type: OutType::F32, ..Default::default() },
    )
    .unwrap();
    let with = tmp.join(format!("{name}-mtp.gguf"));
    nebula_engine::synth::append_random_mtp(&plain, &with, 7).unwrap();
    with
}

/// Runs `req` on `engine` to its end: (tokens, finish reason, usage).
///
/// Panics: the request fails or the worker stops.
pub fn run_request(
    engine: &nebula_engine::worker::Engine,
    req: nebula_engine::worker::GenerateRequest,
) -> (Vec<u32>, nebula_engine::worker::FinishReason, nebula_engine::worker::Usage) {
    use nebula_engine::worker::GenerationEvent;
    let mut rx = engine.submit(req).expect("submits");
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

/// `messages` rendered with `engine`'s chat template (generation prompt added) and tokenized.
///
/// Panics: the engine has no template, or rendering fails.
pub fn chat_prompt(engine: &nebula_engine::worker::Engine, messages: serde_json::Value) -> Vec<u32> {
    let template = engine.chat_template().expect("the model has a chat template");
    let mut req = nebula_engine::text::chat_template::RenderRequest::new(&messages);
    req.add_generation_prompt = true;
    engine.tokenizer().encode(&template.render(&req).unwrap()).unwrap()
}

/// The prefix cache's contract on the demo model, whatever the backend `engine` runs on: resuming from a
/// checkpoint gives the same greedy output as prefilling everything (the cache off), and only the tokens after
/// the checkpoint are prefilled (counted by the engine's `prefilled_tokens`): an exact repeat none, a follow-up
/// turn only the new message, a new chat sharing the system prompt only what follows the system turn, and a
/// follow-up whose last message was edited only what follows the turn boundary before the edit. Returns the
/// cached-token count of each warm request, for the caller's report.
///
/// Panics: any of these fails.
pub fn check_prefix_cache(engine: &nebula_engine::worker::Engine) -> Vec<usize> {
    use nebula_engine::worker::GenerateRequest;
    use std::sync::atomic::Ordering::Relaxed;
    let im_start = engine.tokenizer().token_to_id("<|im_start|>").expect("the chat template's turn token");
    let fresh = |ids: &[u32]| {
        let mut req = GenerateRequest::new(ids.to_vec(), 60);
        req.use_prefix_cache = false;
        run_request(engine, req).0
    };
    let mut cached = Vec::new();
    // Runs `ids` with the cache and checks it resumed at `want` (or at least `at_least` when `want` is None)
    // and prefilled exactly the rest, with the fresh run's tokens.
    let mut warm = |ids: &[u32], want: Option<usize>, at_least: usize, what: &str| {
        let before = engine.stats().prefilled_tokens.load(Relaxed);
        let (out, _, usage) = run_request(engine, GenerateRequest::new(ids.to_vec(), 60));
        let prefilled = engine.stats().prefilled_tokens.load(Relaxed) - before;
        if let Some(w) = want {
            assert_eq!(usage.cached_tokens, w, "{what}: resumed at {} instead of {w}", usage.cached_tokens);
        }
        assert!(usage.cached_tokens >= at_least, "{what}: resumed at {} < {at_least}", usage.cached_tokens);
        assert_eq!(prefilled, ids.len() - usage.cached_tokens, "{what}: prefilled more than the uncached tokens");
        assert_eq!(out, fresh(ids), "{what}: the resumed output differs from a cold run's");
        cached.push(usage.cached_tokens);
        out
    };
    let system = "You are the Nebula demo model. Answer briefly.";
    let first = chat_prompt(
        engine,
        serde_json::json!([{"role": "system", "content": system}, {"role": "user", "content": "Hello!"}]),
    );
    let (out1, _, usage) = run_request(engine, GenerateRequest::new(first.clone(), 60));
    assert_eq!(out1, fresh(&first), "a cold run with the cache on equals one with it off");
    assert!(usage.cached_tokens < first.len());

    // Exact repeat: nothing to prefill.
    let again = warm(&first, Some(first.len()), 0, "exact repeat");
    assert_eq!(again, out1);

    // Follow-up turn: the first prompt, its answer and a new message.
    let text = engine.tokenizer().decode(&out1, false).unwrap();
    let (reasoning, answer) = text.split_once("</think>").unwrap_or(("", &text));
    let history = serde_json::json!([{"role": "system", "content": system}, {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": answer.trim(), "reasoning_content": reasoning.trim()}]);
    let with = |user: &str| {
        let mut m = history.clone();
        m.as_array_mut().unwrap().push(serde_json::json!({"role": "user", "content": user}));
        chat_prompt(engine, m)
    };
    let follow = with("What is 2 + 2?");
    assert!(follow.starts_with(&first));
    warm(&follow, Some(first.len() + out1.len()), 0, "follow-up turn");

    // A new chat with the same system prompt resumes after the system turn.
    let other = chat_prompt(
        engine,
        serde_json::json!([{"role": "system", "content": system}, {"role": "user", "content": "Name a planet."}]),
    );
    let system_turn = first.iter().skip(1).position(|&t| t == im_start).unwrap() + 1;
    warm(&other, Some(system_turn), 0, "shared system prompt");

    // The follow-up with its last message edited: resumes no later than the edit, no earlier than the turn
    // boundary before it.
    let edited = with("What is 3 + 3?");
    let edit = edited.iter().zip(&follow).take_while(|(a, b)| a == b).count();
    let turn = edited[..edit].iter().rposition(|&t| t == im_start).expect("a turn before the edit");
    let (_, _, usage) = {
        let before = engine.stats().prefilled_tokens.load(Relaxed);
        let r = run_request(engine, GenerateRequest::new(edited.clone(), 60));
        assert_eq!(engine.stats().prefilled_tokens.load(Relaxed) - before, edited.len() - r.2.cached_tokens);
        r
    };
    assert!(
        usage.cached_tokens >= turn && usage.cached_tokens <= edit,
        "mid-prompt edit resumed at {}",
        usage.cached_tokens
    );
    warm(&edited, Some(edited.len()), 0, "the edited follow-up repeated");
    cached.push(usage.cached_tokens);
    cached
}

/// The on-disk prompt cache across a restart, on the demo model with `opts` (backend, placement): a first engine
/// answers a chat and writes it to `dir`; a second engine on the same directory resumes an exact repeat of the
/// chat from disk (every prompt token cached, counted as disk hits) and answers as a cold run does.
///
/// Panics: any of these fails.
pub fn check_disk_cache_restart(opts: nebula_engine::worker::EngineOptions, dir: &std::path::Path) {
    use nebula_engine::worker::{Engine, GenerateRequest};
    use std::sync::atomic::Ordering::Relaxed;
    let path = repo_root().join("models/nebula-demo.gguf");
    let mut opts = opts;
    opts.prefix_cache.disk_dir = Some(dir.to_path_buf());
    opts.prefix_cache.disk_max_bytes = 1 << 30;
    let messages = serde_json::json!([{"role": "user", "content": "Hello!"}]);
    let (prompt, first) = {
        let engine = Engine::load(&path, opts.clone()).expect("the demo model loads");
        let prompt = chat_prompt(&engine, messages.clone());
        let (out, _, _) = run_request(&engine, GenerateRequest::new(prompt.clone(), 40));
        // The write runs on its own thread: wait for it (bounded) before the engine goes.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while engine.stats().disk_writes.load(Relaxed) == 0 {
            assert!(std::time::Instant::now() < deadline, "the finished chat was not written to disk");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        (prompt, out)
    };
    let engine = Engine::load(&path, opts).expect("the demo model loads again");
    let (again, _, usage) = run_request(&engine, GenerateRequest::new(prompt.clone(), 40));
    assert_eq!(usage.cached_tokens, prompt.len(), "the repeat after a restart resumed from disk");
    assert!(engine.stats().disk_hits.load(Relaxed) >= prompt.len());
    assert_eq!(again, first, "the answer resumed from disk equals the first run's");
    let mut cold = GenerateRequest::new(prompt, 40);
    cold.use_prefix_cache = false;
    assert_eq!(run_request(&engine, cold).0, first, "and a cold run's");
}

/// A `nebula serve` with `config` on its own two-worker runtime thread, for the HTTP end-to-end tests: returns its
/// base URL and the served model once the model is loaded. The server runs until the test process ends.
///
/// Panics: the server cannot bind or the model does not load.
pub fn spawn_server(
    config: nebula_service::ServerConfig,
) -> (String, std::sync::Arc<nebula_service::state::ServedModel>) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        runtime.block_on(async move {
            let handle = nebula_service::start(config).await.expect("the server binds");
            let model = handle.ready().await.expect("the demo model loads");
            tx.send((handle.base_url(), model)).unwrap();
            let _ = handle.wait().await;
        });
    });
    rx.recv().expect("the server thread reports its address")
}

/// The long-context golden case (`tests/fixtures/golden/long10k`, written by `scripts/make_golden.py` from
/// transformers 5.24 `Qwen4ExpForCausalLM`): 10,240 tokens, the reference's top-1 id and margin at every
/// position from `first` on, and its logits at `positions`.
pub struct LongGolden {
    /// Every token.
    pub ids: Vec<u32>,
    /// First position whose top-1 is stored (8,192).
    pub first: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// The reference's argmax at positions `first..`.
    pub top1: Vec<u32>,
    /// Its margin over the second largest logit there.
    pub margin: Vec<f32>,
    /// Positions whose logits are stored (every 8th from `first`).
    pub positions: Vec<usize>,
    /// Those logits, `[positions.len(), vocab]`.
    pub logits: Vec<f32>,
    /// Largest |logit| over every position from `first` on.
    pub max_abs_logit: f32,
}

/// Reads [`LongGolden`].
///
/// Panics: the fixture is missing or malformed (test setup).
pub fn load_long_golden() -> LongGolden {
    let dir = repo_root().join("tests/fixtures/golden/long10k");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let u32s =
        |k: &str| -> Vec<u32> { meta[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect() };
    let bytes = std::fs::read(dir.join("logits.bin")).unwrap();
    LongGolden {
        ids: u32s("token_ids"),
        first: meta["first_checked"].as_u64().unwrap() as usize,
        vocab: meta["vocab_size"].as_u64().unwrap() as usize,
        top1: u32s("top1"),
        margin: meta["top1_margin"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect(),
        positions: u32s("logit_positions").into_iter().map(|p| p as usize).collect(),
        logits: bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        max_abs_logit: meta["max_abs_logit"].as_f64().unwrap() as f32,
    }
}

/// The long-context golden checkpoint converted to an F32 GGUF in `tmp`; returns its path.
///
/// Panics: the conversion fails (test setup).
pub fn long_golden_gguf(tmp: &std::path::Path) -> PathBuf {
    use nebula_engine::convert::{ConvertOptions, OutType, convert};
    let out = tmp.join("long10k.gguf");
    let dir = repo_root().join("tests/fixtures/golden/long10k");
    convert(&dir, &out, &ConvertOptions { out_type: OutType::F32, ..Default::default() }).unwrap();
    out
}

/// What a backend produced on [`LongGolden`]: its argmax at positions `first..` and its logits at the stored
/// positions.
pub struct LongRun {
    /// Argmax at `first..`.
    pub top1: Vec<u32>,
    /// Its margin over the second largest logit there.
    pub margin: Vec<f32>,
    /// Logits at [`LongGolden::positions`], `[positions, vocab]`.
    pub logits: Vec<f32>,
}

/// Runs `backend` over the long golden's tokens: prefill chunks of `chunk` tokens up to `decode_from`, then one
/// token a step, collecting [`LongRun`].
///
/// Panics: a forward pass fails (the test fails with its error).
pub fn run_long<B: nebula_engine::backend::Backend>(
    backend: &B,
    g: &LongGolden,
    chunk: usize,
    decode_from: usize,
) -> LongRun {
    use nebula_engine::model::LogitsFor;
    let n = g.ids.len();
    let mut state = backend.new_state(n, false).expect("a state for the long golden");
    let (mut top1, mut margin, mut logits) = (Vec::new(), Vec::new(), Vec::new());
    let mut keep = |pos: usize, row: &[f32]| {
        if pos >= g.first {
            let best =
                row.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b });
            let second =
                row.iter().enumerate().filter(|&(i, _)| i != best.0).fold(f32::NEG_INFINITY, |m, (_, &v)| m.max(v));
            top1.push(best.0 as u32);
            margin.push(best.1 - second);
        }
        if g.positions.binary_search(&pos).is_ok() {
            logits.extend_from_slice(row);
        }
    };
    let mut pos = 0;
    while pos < n {
        let len = if pos < decode_from { chunk.min(decode_from - pos) } else { 1 };
        let want = if pos + len > g.first { LogitsFor::All } else { LogitsFor::None };
        let out = backend.forward(&mut state, &g.ids[pos..pos + len], want).expect("a long-golden pass");
        if want == LogitsFor::All {
            for (i, row) in out.chunks_exact(g.vocab).enumerate() {
                keep(pos + i, row);
            }
        }
        pos += len;
    }
    LongRun { top1, margin, logits }
}

/// (Share of positions `first..` where `run`'s top-1 is the reference's, largest |logit - reference| at the
/// stored positions relative to the reference's largest |logit|, positions whose top-1 differs although the
/// reference's margin exceeds `clear` times its largest |logit|).
pub fn long_agreement(g: &LongGolden, run: &LongRun, clear: f32) -> (f64, f32, Vec<usize>) {
    assert_eq!(run.top1.len(), g.top1.len(), "top-1 rows");
    assert_eq!(run.logits.len(), g.logits.len(), "logit rows");
    let same = run.top1.iter().zip(&g.top1).filter(|(a, b)| a == b).count();
    let worst = run.logits.iter().zip(&g.logits).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst.is_finite(), "non-finite logits");
    let clear_flips = (0..g.top1.len())
        .filter(|&i| run.top1[i] != g.top1[i] && g.margin[i] > clear * g.max_abs_logit)
        .map(|i| g.first + i)
        .collect();
    (same as f64 / g.top1.len() as f64, worst / g.max_abs_logit, clear_flips)
}
