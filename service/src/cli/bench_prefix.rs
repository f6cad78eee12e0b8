//! `nebula bench prefix`: time to first token of a follow-up turn resumed from the prefix cache, against a cold
//! prefill of the same prompt, in one run and interleaved.
//!
//! For each context size `C` and each repeat, a fresh random conversation: a first turn of `C` tokens (an
//! `<|im_start|>` then ordinary tokens) is answered with `--answer` tokens (the cache keeps it), then the
//! follow-up prompt (first turn + answer + `<|im_start|>` + `--new-tokens` tokens) runs once with the cache and
//! once without it, in alternating order. TTFT is the time from submitting a request to its first token, queue
//! included (the queue is empty). MTP drafting is off: only prefill is measured.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use nebula_engine::backend::BackendKind;
use nebula_engine::prefix_cache::PrefixCacheOptions;
use nebula_engine::worker::{Engine, EngineOptions, GenerateRequest, GenerationEvent};

/// Arguments of `nebula bench prefix`.
#[derive(clap::Args, Debug)]
pub struct BenchPrefixArgs {
    /// GGUF model (default: the embedded demo model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// cpu or cuda.
    #[arg(long, default_value = "cpu")]
    pub backend: BackendKind,
    /// GPU index for the cuda backend.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Tokens of conversation before the follow-up, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "8192,32768")]
    pub contexts: Vec<usize>,
    /// Repeats per context (each a fresh conversation; cold and warm alternate which runs first).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Tokens of the first turn's answer.
    #[arg(long, default_value_t = 32)]
    pub answer: usize,
    /// Tokens of the follow-up message.
    #[arg(long, default_value_t = 64)]
    pub new_tokens: usize,
    /// Prefill chunk size.
    #[arg(long, default_value_t = 2048)]
    pub prefill_chunk: usize,
    /// VRAM the cache may keep, MiB (past it, entries are spilled to host memory and copied back).
    #[arg(long, default_value_t = 4096)]
    pub cache_device_mib: usize,
    /// Hardware profile file to emulate (expert tiers, budgets, threads); the placement flags override it.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Expert placement and emulation.
    #[command(flatten)]
    pub placement: crate::placement::PlacementFlags,
}

/// (TTFT seconds, cached tokens, generated tokens) of `req`, run to its end.
fn ttft(engine: &Engine, req: GenerateRequest) -> anyhow::Result<(f64, usize, Vec<u32>)> {
    let t = Instant::now();
    let mut rx = engine.submit(req).map_err(|e| anyhow::anyhow!("submitting: {e}"))?;
    let (mut first, mut cached, mut out) = (None, 0, Vec::new());
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            GenerationEvent::Started { cached_tokens } => cached = cached_tokens,
            GenerationEvent::Token { id, .. } => {
                first.get_or_insert(t.elapsed().as_secs_f64());
                out.push(id);
            }
            GenerationEvent::Finished { .. } => break,
            GenerationEvent::Failed(e) => anyhow::bail!("generation failed: {e}"),
            GenerationEvent::Prefilled { .. } => {}
        }
    }
    Ok((first.context("no token was generated")?, cached, out))
}

/// Min, median and max of `v`.
fn spread(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[0], v[v.len() / 2], v[v.len() - 1])
}

/// Runs `nebula bench prefix`.
pub fn run_prefix(args: BenchPrefixArgs) -> anyhow::Result<()> {
    // Tuning from the NEBULA_* variables (docs/config.md), read once before the model loads.
    let tuning = nebula_engine::tuning::Tuning::from_env()?;
    nebula_engine::tuning::install_cpu(tuning.cpu.clone());
    let placement = crate::placement::resolve(args.profile.as_deref(), &args.placement).map_err(anyhow::Error::msg)?;
    if let Some(threads) = placement.threads {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().context("setting the compute threads")?;
    }
    let source = args.profile.as_ref().map_or("flags".to_owned(), |p| format!("profile {}", p.display()));
    let longest = args.contexts.iter().max().copied().unwrap_or(0) + args.answer + args.new_tokens + 2;
    let opts = EngineOptions {
        max_context: Some(longest),
        queue_capacity: 4,
        prefix_cache: PrefixCacheOptions {
            max_entries: 4,
            max_bytes: 64 << 30,
            device_bytes: args.cache_device_mib << 20,
            ..Default::default()
        },
        placement: placement.to_options(&source).map_err(anyhow::Error::msg)?,
        mtp: false,
        backend: super::bench::bench_backend(args.backend, args.gpu, &placement),
        cuda_tuning: tuning.cuda,
        ..Default::default()
    };
    let t = Instant::now();
    let engine = match &args.model {
        Some(p) => Engine::load(p, opts).with_context(|| format!("loading {}", p.display()))?,
        None => Engine::from_gguf_bytes("embedded demo model", crate::config::EMBEDDED_DEMO_MODEL.to_vec(), opts)?,
    };
    let im_start = engine.tokenizer().token_to_id("<|im_start|>").unwrap_or(0);
    let vocab = engine.config().vocab.min(248_000) as u64;
    println!(
        "model loaded in {:.1} s; {} repeats per context, cold and warm interleaved",
        t.elapsed().as_secs_f64(),
        args.repeats
    );
    println!(
        "{:>8} {:>8} {:>24} {:>24} {:>22} {:>8} {:>7} {:>10}",
        "context",
        "prompt",
        "cold TTFT s min/med/max",
        "warm TTFT s min/med/max",
        "cold/warm min/med/max",
        "cached",
        "spills",
        "same top-1"
    );
    println!(
        "(prompt: the follow-up's tokens, i.e. the conversation, its answer and the new message; cold/warm: the ratio \
         within each repeat; cached: prompt tokens resumed from the cache; spills: entries moved from VRAM to host \
         memory so far; same top-1: repeats whose warm first token equals the cold one)"
    );
    let mut tokens = super::RandomTokens::new(0x9E37_79B9_7F4A_7C15u64, vocab);
    let mut random = |n: usize| tokens.take(n);
    for &ctx in &args.contexts {
        let (mut cold, mut warm, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
        let (mut cached, mut prompt_len, mut same) = (0, 0, 0);
        for r in 0..args.repeats.max(1) {
            let mut first = vec![im_start];
            first.extend(random(ctx.saturating_sub(1)));
            let answer_req = GenerateRequest {
                ignore_eos: true,
                prefill_chunk: Some(args.prefill_chunk),
                ..GenerateRequest::new(first.clone(), args.answer)
            };
            let (_, _, answer) = ttft(&engine, answer_req)?;
            let mut follow = first;
            follow.extend(&answer);
            follow.push(im_start);
            follow.extend(random(args.new_tokens));
            prompt_len = follow.len();
            let request = |use_cache: bool| GenerateRequest {
                use_prefix_cache: use_cache,
                ignore_eos: true,
                prefill_chunk: Some(args.prefill_chunk),
                ..GenerateRequest::new(follow.clone(), 1)
            };
            let (c, w) = if r % 2 == 0 {
                let c = ttft(&engine, request(false))?;
                (c, ttft(&engine, request(true))?)
            } else {
                let w = ttft(&engine, request(true))?;
                (ttft(&engine, request(false))?, w)
            };
            same += usize::from(c.2 == w.2);
            cached = w.1;
            cold.push(c.0);
            warm.push(w.0);
            ratio.push(c.0 / w.0);
        }
        let (c, w, q) = (spread(&mut cold), spread(&mut warm), spread(&mut ratio));
        let spills = engine.stats().cache_spills.load(std::sync::atomic::Ordering::Relaxed);
        println!(
            "{ctx:>8} {prompt_len:>8} {:>8.3}/{:.3}/{:.3} {:>8.4}/{:.4}/{:.4} {:>8.1}/{:.1}/{:.1}x {cached:>8} {spills:>7} {:>7}/{}",
            c.0,
            c.1,
            c.2,
            w.0,
            w.1,
            w.2,
            q.0,
            q.1,
            q.2,
            same,
            args.repeats.max(1)
        );
    }
    Ok(())
}
