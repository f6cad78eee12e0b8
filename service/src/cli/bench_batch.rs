//! `nebula bench batch`: aggregate decode throughput and time to first token at several numbers of concurrent
//! streams, with continuous batching and with it switched off (one request at a time), in one run and
//! interleaved.
//!
//! For each round, each concurrency `C` and each mode (the order of the modes alternates by round), `C`
//! requests with distinct random prompts of `--prompt` tokens are submitted at once, each generating `--tokens`
//! tokens (end-of-turn ignored, the prefix cache off, MTP drafting as `--mtp` says); both modes are warmed up
//! first. Every request's events are read on a thread of its own, so each is timed as it arrives. Reported: the
//! aggregate rate (every generated token over the wall time from the first submission to the last finish, prefill
//! included), the decode rate (tokens after each request's first, over the time at least one request was
//! decoding: llama-batched-bench's `S_TG` for the batched mode) and TTFT per request, from its submission to its
//! first token (queue included). The same `Engine` serves both modes
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
    /// Routing.
    #[command(flatten)]
    pub routing: super::bench::RoutingFlags,
}

/// One mode's run at one concurrency.
struct Run {
    /// Every generated token over the wall time, prefill included.
    tok_s: f64,
    /// Tokens after each request's first over the time some request was decoding (the union of the requests'
    /// first-to-last-token intervals): the decode rate, comparable to llama-batched-bench's `S_TG`.
    decode_tok_s: f64,
    ttft: Vec<f64>,
}

/// Submits `prompts` at once, each generating `tokens`, and reads every request's events on a thread of its own
/// (so each event is timed when it arrives): the aggregate and decode rates and each TTFT.
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
    // Per request: (seconds from its submission to its first token, first and last token times from `t`, tokens).
    let results: Vec<anyhow::Result<(f64, f64, f64, usize)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = rxs
            .into_iter()
            .map(|(sent, mut rx)| {
                scope.spawn(move || {
                    let (mut first, mut last, mut n) = (None, 0.0, 0usize);
                    while let Some(ev) = rx.blocking_recv() {
                        match ev {
                            GenerationEvent::Token { .. } => {
                                let now = t.elapsed().as_secs_f64();
                                first.get_or_insert((sent.elapsed().as_secs_f64(), now));
                                last = now;
                                n += 1;
                            }
                            GenerationEvent::Finished { .. } => break,
                            GenerationEvent::Failed(e) => anyhow::bail!("generation failed: {e}"),
                            _ => {}
                        }
                    }
                    let (ttft, at) = first.context("a request generated no token")?;
                    Ok((ttft, at, last, n))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a reader thread panicked")).collect()
    });
    let wall = t.elapsed().as_secs_f64();
    let results: Vec<(f64, f64, f64, usize)> = results.into_iter().collect::<anyhow::Result<_>>()?;
    let generated: usize = results.iter().map(|r| r.3).sum();
    let after_first: usize = results.iter().map(|r| r.3.saturating_sub(1)).sum();
    let mut spans: Vec<(f64, f64)> = results.iter().map(|r| (r.1, r.2)).collect();
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (mut busy, mut end) = (0.0, f64::NEG_INFINITY);
    for (a, b) in spans {
        if a > end {
            busy += b - a;
            end = b;
        } else if b > end {
            busy += b - end;
            end = b;
        }
    }
    Ok(Run {
        tok_s: generated as f64 / wall,
        decode_tok_s: if busy > 0.0 { after_first as f64 / busy } else { 0.0 },
        ttft: results.iter().map(|r| r.0).collect(),
    })
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
    let steps = StepTimes::default();
    let mid_rows = tuning.cuda.mid_rows;
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
        step_observer: Some(steps.observer()),
        realistic_routing: (args.routing.routing == super::bench::RoutingMode::Realistic)
            .then_some(args.routing.routing_seed),
        ..Default::default()
    };
    let t = Instant::now();
    let engine = match &args.model {
        Some(p) => Engine::load(p, opts).with_context(|| format!("loading {}", p.display()))?,
        None => Engine::from_gguf_bytes("embedded demo model", crate::config::EMBEDDED_DEMO_MODEL.to_vec(), opts)?,
    };
    let vocab = engine.config().vocab.min(248_000) as u64;
    let cfg = engine.config();
    let shape = nebula_engine::synth::routing::RoutingShape {
        n_layer: cfg.n_layer,
        n_expert: cfg.n_expert,
        top_k: cfg.n_expert_used,
    };
    // The same process the engine runs (same seed, same shape: the same rows), read back for the report.
    let realistic = args.routing.realistic(shape)?;
    super::bench::print_routing(realistic.as_deref());
    println!(
        "model loaded in {:.1} s; {} rounds, prompts of {} tokens, {} tokens per request, MTP {}",
        t.elapsed().as_secs_f64(),
        args.rounds,
        args.prompt,
        args.tokens,
        if args.mtp { "on" } else { "off" }
    );
    if matches!(args.backend, BackendKind::Cuda { .. }) {
        println!("{}", mid_path_line(mid_rows, args.deterministic));
    }
    let mut tokens = super::RandomTokens::new(0x2545_F491_4F6C_DD1Du64, vocab);
    let mut random = |n: usize| tokens.take(n);
    // Warm up both modes (first passes allocate arenas, capture graphs, fault pages in); not reported.
    for on in [true, false] {
        engine.set_max_sequences(if on { widest } else { 1 });
        let warm: Vec<Vec<u32>> = (0..widest.min(4)).map(|_| random(args.prompt)).collect();
        run_once(&engine, &warm, args.tokens.min(8), args.mtp)?;
    }
    // (concurrency, batched runs, baseline runs)
    let mut results: Vec<(usize, Vec<Run>, Vec<Run>)> =
        args.concurrency.iter().map(|&c| (c, Vec::new(), Vec::new())).collect();
    let mut widest_prompts: Vec<Vec<u32>> = Vec::new();
    for round in 0..args.rounds.max(1) {
        for (c, batched, baseline) in &mut results {
            let prompts: Vec<Vec<u32>> = (0..*c).map(|_| random(args.prompt)).collect();
            if *c == widest {
                widest_prompts = prompts.clone();
            }
            let modes: &[bool] = match (args.no_baseline, round % 2) {
                (true, _) => &[true],
                (false, 0) => &[true, false],
                (false, _) => &[false, true],
            };
            for &on in modes {
                engine.set_max_sequences(if on { widest } else { 1 });
                let run = run_once(&engine, &prompts, args.tokens, args.mtp)?;
                println!(
                    "round {round} streams {c:>3} {:>10}: {:>9.1} tok/s, decode {:>9.1} tok/s, TTFT median {:.3} s",
                    if on { "batched" } else { "one-by-one" },
                    run.tok_s,
                    run.decode_tok_s,
                    quantile(&mut run.ttft.clone(), 0.5)
                );
                if on { batched.push(run) } else { baseline.push(run) }
            }
        }
    }
    println!();
    println!(
        "{:>7} {:>14} {:>14} {:>10} {:>14} {:>14} {:>10} {:>10} {:>12} {:>12} {:>12}",
        "streams",
        "batched tok/s",
        "1-by-1 tok/s",
        "ratio",
        "batched dec",
        "1-by-1 dec",
        "dec ratio",
        "x 1 stream",
        "TTFT med s",
        "TTFT p95 s",
        "1x1 p95 s"
    );
    println!(
        "(ranges over the rounds. tok/s: every generated token over the wall time, prefill included; dec: the decode \
         rate, tokens after each request's first over the time some request was decoding; ratio and dec ratio: \
         batched over one-by-one within each round; x 1 stream: batched decode rate over the single-stream batched \
         decode rate of the same round; TTFT from each request's submission, queue included)"
    );
    let single: Vec<f64> =
        results.iter().find(|r| r.0 == 1).map(|r| r.1.iter().map(|x| x.decode_tok_s).collect()).unwrap_or_default();
    for (c, batched, baseline) in &mut results {
        let b: Vec<f64> = batched.iter().map(|r| r.tok_s).collect();
        let o: Vec<f64> = baseline.iter().map(|r| r.tok_s).collect();
        let bd: Vec<f64> = batched.iter().map(|r| r.decode_tok_s).collect();
        let od: Vec<f64> = baseline.iter().map(|r| r.decode_tok_s).collect();
        let ratio: Vec<f64> = b.iter().zip(&o).map(|(x, y)| x / y).collect();
        let dratio: Vec<f64> = bd.iter().zip(&od).map(|(x, y)| x / y).collect();
        let scale: Vec<f64> = bd.iter().zip(&single).map(|(x, y)| x / y).collect();
        let med: Vec<f64> = batched.iter_mut().map(|r| quantile(&mut r.ttft, 0.5)).collect();
        let p95: Vec<f64> = batched.iter_mut().map(|r| quantile(&mut r.ttft, 0.95)).collect();
        let op95: Vec<f64> = baseline.iter_mut().map(|r| quantile(&mut r.ttft, 0.95)).collect();
        let or_dash = |v: &[f64], d: usize| if v.is_empty() { "-".to_owned() } else { range(v, d) };
        println!(
            "{c:>7} {:>14} {:>14} {:>10} {:>14} {:>14} {:>10} {:>10} {:>12} {:>12} {:>12}",
            range(&b, 1),
            or_dash(&o, 1),
            or_dash(&ratio, 2),
            range(&bd, 1),
            or_dash(&od, 1),
            or_dash(&dratio, 2),
            or_dash(&scale, 2),
            range(&med, 3),
            range(&p95, 3),
            or_dash(&op95, 3),
        );
    }
    steps.print();
    if let Some(r) = &realistic {
        print_batch_routing(r, &widest_prompts, args.prompt..args.prompt + args.tokens);
    } else {
        println!("routing: the routers' choices are not collected by bench batch (bench model reports them)");
    }
    Ok(())
}

/// Which kernels the GPU's batched passes take for their 8-bit products (`tuning.cuda.mid_rows`,
/// `NEBULA_CUDA_MID_ROWS`), for the A/B of the mid-size kernels.
fn mid_path_line(mid_rows: usize, deterministic: bool) -> String {
    if deterministic {
        "GPU batched passes: deterministic (each row on a decode step's kernels; NEBULA_CUDA_MID_ROWS does not apply)"
            .to_owned()
    } else if mid_rows >= 2 {
        format!(
            "GPU batched passes: mid-size kernels up to {mid_rows} rows (NEBULA_CUDA_MID_ROWS={mid_rows}: dense \
             gemvqm_*, routed experts grouped by expert moe_gemvqg_* from 5 rows; 8-bit types only)"
        )
    } else {
        format!(
            "GPU batched passes: mid-size kernels off (NEBULA_CUDA_MID_ROWS={mid_rows}: dense one-row GEMVs up to 8 rows and \
             per-slot expert GEMVs up to 4, the prefill kernels beyond)"
        )
    }
}

/// Decode passes by batch size (sequences), from the engine's step observer: how long `forward_batch` took and
/// how long a whole step took (from one pass's end to the next's: the pass plus the scheduler's host work, for
/// steps that follow each other).
#[derive(Clone, Default)]
struct StepTimes(std::sync::Arc<std::sync::Mutex<StepTally>>);

#[derive(Default)]
struct StepTally {
    /// sequences -> (passes, pass seconds, steps timed, step seconds)
    by_size: std::collections::BTreeMap<usize, (u64, f64, u64, f64)>,
    last: Option<Instant>,
}

impl StepTimes {
    fn observer(&self) -> nebula_engine::worker::StepObserver {
        let tally = self.0.clone();
        nebula_engine::worker::StepObserver(std::sync::Arc::new(move |r| {
            let now = Instant::now();
            let mut t = tally.lock().expect("step tally lock");
            let gap = t.last.map(|l| now.duration_since(l).as_secs_f64());
            t.last = Some(now);
            if r.decode_rows == r.tokens && r.sequences > 0 {
                let e = t.by_size.entry(r.sequences).or_default();
                e.0 += 1;
                e.1 += r.seconds;
                // A gap much longer than the pass is a pause between requests, not a step.
                if let Some(g) = gap.filter(|&g| g < 4.0 * r.seconds + 0.05) {
                    e.2 += 1;
                    e.3 += g;
                }
            }
        }))
    }

    fn print(&self) {
        let t = self.0.lock().expect("step tally lock");
        println!();
        println!(
            "decode passes by batch size (every round and warm-up): forward_batch ms, whole step ms (pass + host)"
        );
        println!("{:>9} {:>8} {:>10} {:>10}", "sequences", "passes", "pass ms", "step ms");
        for (&size, &(n, pass, m, step)) in &t.by_size {
            let mean = |s: f64, k: u64| if k == 0 { f64::NAN } else { s / k as f64 * 1e3 };
            println!("{size:>9} {n:>8} {:>10.3} {:>10.3}", mean(pass, n), mean(step, m));
        }
    }
}

/// The realistic routing of the widest concurrency's last requests over their decoded positions: one request's
/// figures, and how many distinct experts a layer's step needs for all of them together (what a batched pass reads
/// once) against the uses it serves.
fn print_batch_routing(
    r: &nebula_engine::synth::routing::RealisticRouting,
    prompts: &[Vec<u32>],
    positions: std::ops::Range<usize>,
) {
    use nebula_engine::synth::routing::{RoutingOverride, stream_key};
    let streams: Vec<u64> = prompts.iter().filter_map(|p| p.first()).map(|&t| stream_key(t)).collect();
    let Some(&first) = streams.first() else { return };
    println!(
        "routing of one request's decode ({} positions, realistic): {}",
        positions.len(),
        r.stats(first, positions.clone()).summary(25)
    );
    let shape = r.shape();
    let rows: Vec<_> = streams.iter().map(|&s| r.rows(s, positions.start, positions.len())).collect();
    let (mut distinct, mut uses) = (0usize, 0usize);
    for t in 0..positions.len() {
        for li in 0..shape.n_layer {
            let mut union: Vec<u32> = rows.iter().flat_map(|x| x.experts(t, li).iter().copied()).collect();
            uses += union.len();
            union.sort_unstable();
            union.dedup();
            distinct += union.len();
        }
    }
    let steps = (positions.len() * shape.n_layer).max(1) as f64;
    println!(
        "routing of the {} requests' decode together: {:.1} distinct experts per layer and step for {:.1} uses",
        streams.len(),
        distinct as f64 / steps,
        uses as f64 / steps
    );
}
