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
