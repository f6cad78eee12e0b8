//! `nebula bench batch`: aggregate decode throughput and time to first token at several numbers of concurrent
//! streams, with continuous batching and with it switched off (one request at a time), in one run and
//! interleaved.
//!
//! For each round, each concurrency `C` and each mode (the order of the modes alternates by round), `C`
//! requests with distinct random prompts of `--prompt` tokens are submitted at once, each generating `--tokens`
//! tokens (end-of-turn ignored, the prefix cache off, MTP drafting as `--mtp` says). Aggregate tok/s is every
//! generated token over the wall time from the first submission to the last finish; TTFT is per request, from
//! its submission to its first token (queue included). The same `Engine` serves both modes
//! (`Engine::set_max_sequences`), so the weights, placement and caches are identical.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use nebula_engine::backend::{BackendKind, BatchMode};
use nebula_engine::prefix_cache::PrefixCacheOptions;
use nebula_engine::worker::{BatchOptions, Engine, EngineOptions, GenerateRequest, GenerationEvent};

/// Arguments of `nebula bench batch`.
#[derive(clap::Args, Debug)]
pub struct BenchBatchArgs {
    /// GGUF model (default: the embedded demo model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// cpu or cuda.
    #[arg(long, default_value = "cpu")]
    pub backend: BackendKind,
    /// GPU index for the cuda backend.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Concurrent streams, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    pub concurrency: Vec<usize>,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 128)]
    pub prompt: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 64)]
    pub tokens: usize,
    /// Rounds (each runs every concurrency in both modes; the modes alternate which goes first).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Let requests draft with the model's MTP block (when it has one).
    #[arg(long)]
    pub mtp: bool,
    /// Run the GPU's batched passes in deterministic mode (each row as alone).
    #[arg(long)]
    pub deterministic: bool,
    /// Only the batched mode (no batching-off baseline).
    #[arg(long)]
    pub no_baseline: bool,
    /// Hardware profile file to emulate (expert tiers, budgets, threads); the placement flags override it.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Expert placement and emulation.
    #[command(flatten)]
    pub placement: crate::placement::PlacementFlags,
}

/// One mode's run at one concurrency.
struct Run {
    tok_s: f64,
    ttft: Vec<f64>,
}

/// Submits `prompts` at once, each generating `tokens`; the aggregate rate and each TTFT.
fn run_once(engine: &Engine, prompts: &[Vec<u32>], tokens: usize, mtp: bool) -> anyhow::Result<Run> {
    let t = Instant::now();
    let mut rxs = Vec::with_capacity(prompts.len());
    for p in prompts {
        let req = GenerateRequest {
            ignore_eos: true,
            use_prefix_cache: false,
            speculative: mtp,
            ..GenerateRequest::new(p.clone(), tokens)
        };
        rxs.push((Instant::now(), engine.submit(req).map_err(|e| anyhow::anyhow!("submitting: {e}"))?));
    }
    let mut generated = 0;
    let mut ttft = Vec::with_capacity(prompts.len());
    for (sent, mut rx) in rxs {
        let mut first = None;
        while let Some(ev) = rx.blocking_recv() {
            match ev {
                GenerationEvent::Token { .. } => {
                    first.get_or_insert(sent.elapsed().as_secs_f64());
                    generated += 1;
                }
                GenerationEvent::Finished { .. } => break,
                GenerationEvent::Failed(e) => anyhow::bail!("generation failed: {e}"),
                _ => {}
            }
        }
        ttft.push(first.context("a request generated no token")?);
    }
    Ok(Run { tok_s: generated as f64 / t.elapsed().as_secs_f64(), ttft })
}

/// The `q`-quantile of `v` (nearest rank).
fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

/// Min and max of `v` as `min-max`.
fn range(v: &[f64], digits: usize) -> String {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{lo:.digits$}-{hi:.digits$}")
}

/// Runs `nebula bench batch`.
pub fn run_batch(args: BenchBatchArgs) -> anyhow::Result<()> {
    let tuning = nebula_engine::tuning::Tuning::from_env()?;
    nebula_engine::tuning::install_cpu(tuning.cpu.clone());
    let placement = crate::placement::resolve(args.profile.as_deref(), &args.placement).map_err(anyhow::Error::msg)?;
    if let Some(threads) = placement.threads {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().context("setting the compute threads")?;
    }
    let source = args.profile.as_ref().map_or("flags".to_owned(), |p| format!("profile {}", p.display()));
    let widest = args.concurrency.iter().copied().max().unwrap_or(1).max(1);
    let opts = EngineOptions {
        max_context: Some(args.prompt + args.tokens + 8),
        queue_capacity: widest,
        prefix_cache: PrefixCacheOptions { max_entries: 0, ..Default::default() },
        placement: placement.to_options(&source).map_err(anyhow::Error::msg)?,
        mtp: args.mtp,
        backend: super::bench::bench_backend(args.backend, args.gpu, &placement),
        cuda_tuning: tuning.cuda,
        batch: BatchOptions {
            max_sequences: widest,
            mode: if args.deterministic { BatchMode::Deterministic } else { BatchMode::Fast },
            ..Default::default()
        },
        ..Default::default()
    };
    let t = Instant::now();
    let engine = match &args.model {
        Some(p) => Engine::load(p, opts).with_context(|| format!("loading {}", p.display()))?,
        None => Engine::from_gguf_bytes("embedded demo model", crate::config::EMBEDDED_DEMO_MODEL.to_vec(), opts)?,
    };
    let vocab = engine.config().vocab.min(248_000) as u64;
    println!(
        "model loaded in {:.1} s; {} rounds, prompts of {} tokens, {} tokens per request, MTP {}",
        t.elapsed().as_secs_f64(),
        args.rounds,
        args.prompt,
        args.tokens,
        if args.mtp { "on" } else { "off" }
    );
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut random = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed % vocab) as u32
            })
            .collect()
    };
    // (concurrency, batched runs, baseline runs)
    let mut results: Vec<(usize, Vec<Run>, Vec<Run>)> =
        args.concurrency.iter().map(|&c| (c, Vec::new(), Vec::new())).collect();
    for round in 0..args.rounds.max(1) {
        for (c, batched, baseline) in &mut results {
            let prompts: Vec<Vec<u32>> = (0..*c).map(|_| random(args.prompt)).collect();
            let modes: &[bool] = match (args.no_baseline, round % 2) {
                (true, _) => &[true],
                (false, 0) => &[true, false],
                (false, _) => &[false, true],
            };
            for &on in modes {
                engine.set_max_sequences(if on { widest } else { 1 });
                let run = run_once(&engine, &prompts, args.tokens, args.mtp)?;
                println!(
                    "round {round} streams {c:>3} {:>9}: {:>9.1} tok/s, TTFT median {:.3} s",
                    if on { "batched" } else { "one-by-one" },
                    run.tok_s,
                    quantile(&mut run.ttft.clone(), 0.5)
                );
                if on { batched.push(run) } else { baseline.push(run) }
            }
        }
    }
    println!();
    println!(
        "{:>7} {:>18} {:>18} {:>16} {:>14} {:>14} {:>14} {:>14} {:>12}",
        "streams",
        "batched tok/s",
        "one-by-one tok/s",
        "batched/1-by-1",
        "x 1 stream",
        "TTFT med s",
        "TTFT p95 s",
        "1-by-1 p95 s",
        "1-by-1 med s"
    );
    println!(
        "(ranges over the rounds; batched/1-by-1: the ratio within each round; x 1 stream: batched aggregate over the \
         batched single-stream rate of the same round)"
    );
    let single: Vec<f64> =
        results.iter().find(|r| r.0 == 1).map(|r| r.1.iter().map(|x| x.tok_s).collect()).unwrap_or_default();
    for (c, batched, baseline) in &mut results {
        let b: Vec<f64> = batched.iter().map(|r| r.tok_s).collect();
        let o: Vec<f64> = baseline.iter().map(|r| r.tok_s).collect();
        let ratio: Vec<f64> = b.iter().zip(&o).map(|(x, y)| x / y).collect();
        let scale: Vec<f64> = b.iter().zip(&single).map(|(x, y)| x / y).collect();
        let med: Vec<f64> = batched.iter_mut().map(|r| quantile(&mut r.ttft, 0.5)).collect();
        let p95: Vec<f64> = batched.iter_mut().map(|r| quantile(&mut r.ttft, 0.95)).collect();
        let omed: Vec<f64> = baseline.iter_mut().map(|r| quantile(&mut r.ttft, 0.5)).collect();
        let op95: Vec<f64> = baseline.iter_mut().map(|r| quantile(&mut r.ttft, 0.95)).collect();
        let or_dash = |v: &[f64], d: usize| if v.is_empty() { "-".to_owned() } else { range(v, d) };
        println!(
            "{c:>7} {:>18} {:>18} {:>16} {:>14} {:>14} {:>14} {:>14} {:>12}",
            range(&b, 1),
            or_dash(&o, 1),
            or_dash(&ratio, 2),
            or_dash(&scale, 2),
            range(&med, 3),
            range(&p95, 3),
            or_dash(&op95, 3),
            or_dash(&omed, 3),
        );
    }
    Ok(())
}
