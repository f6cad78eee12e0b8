//! `nebula bench model` and `nebula bench mtp`.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use nebula_engine::backend::{Backend, BackendError, BackendKind, Loaded, WithBackend};
use nebula_engine::bench::{BenchOptions, BenchRow, decode_bytes, run};
use nebula_engine::model::Qwen4Exp;
use nebula_engine::speculative::bench::{MtpBenchOptions, MtpBenchRow, PassCost, pass_costs, run_mtp_bench};
use nebula_engine::synth::routing::{RealisticRouting, RoutingLog, RoutingShape, RoutingStats, fitted_figures};
use std::sync::Arc;

/// Arguments of `nebula bench model`.
#[derive(clap::Args, Debug)]
pub struct BenchModelArgs {
    /// GGUF model (default: the embedded demo model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// cpu or cuda.
    #[arg(long, default_value = "cpu")]
    pub backend: BackendKind,
    /// GPU index for the cuda backend.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Context frontiers, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "512,2048,8192")]
    pub contexts: Vec<usize>,
    /// Decode steps timed at each frontier.
    #[arg(long, default_value_t = 32)]
    pub decode: usize,
    /// Prefill chunk size.
    #[arg(long, default_value_t = 2048)]
    pub prefill_chunk: usize,
    /// Write the rows as CSV here.
    #[arg(long)]
    pub csv: Option<PathBuf>,
    /// Hardware profile file (`nebula profile detect`) whose expert tiers, n-gram table place, budgets and threads
    /// to emulate (on `--backend cuda` the run is hybrid: GPU-tier experts on the GPU, the rest on the CPU), and
    /// its KV cache type and window; the placement and KV flags below override it.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// How the attention caches store their rows: f32 (exact), f16, q8_0 or q4_0. Default: the profile's, else
    /// f32.
    #[arg(long)]
    pub kv_cache_type: Option<nebula_engine::model::KvCacheType>,
    /// The CUDA hot window of the KV cache, tokens (0: every token in VRAM). Default: the profile's, else
    /// `NEBULA_CUDA_KV_WINDOW`, else 0.
    #[arg(long)]
    pub kv_window: Option<usize>,
    /// Expert placement and emulation.
    #[command(flatten)]
    pub placement: crate::placement::PlacementFlags,
    /// Routing.
    #[command(flatten)]
    pub routing: RoutingFlags,
}

/// Which experts the benchmark's tokens use.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RoutingMode {
    /// The model's own routers (on a synth: independent draws per token, with the synth's skew).
    #[default]
    Independent,
    /// A seeded process with the real model's skew and temporal reuse in place of the routers (docs/hybrid.md).
    Realistic,
}

/// `--routing` and `--routing-seed` of the decoding benchmarks.
#[derive(clap::Args, Debug, Clone, Copy, Default)]
pub struct RoutingFlags {
    /// independent (the model's routers) or realistic (the fitted routing process in their place; only which
    /// experts run and their weights change, never the math).
    #[arg(long, value_enum, default_value_t = RoutingMode::Independent)]
    pub routing: RoutingMode,
    /// Seed of the realistic routing.
    #[arg(long, default_value_t = 1)]
    pub routing_seed: u64,
}

impl RoutingFlags {
    /// The realistic routing for `shape` when asked for (what the model gets in place of its routers; a second
    /// one with the same seed gives the same rows, so a report can read them back).
    ///
    /// Errors: the model's shape cannot be routed (more than 65,536 experts).
    pub fn realistic(&self, shape: RoutingShape) -> anyhow::Result<Option<Arc<RealisticRouting>>> {
        Ok(match self.routing {
            RoutingMode::Independent => None,
            RoutingMode::Realistic => Some(Arc::new(RealisticRouting::new(shape, self.routing_seed)?)),
        })
    }

    /// Puts the routing on `model` (before it goes to a backend) and a log of what its forward passes use;
    /// prints which routing runs and, when realistic, how its figures compare with the published ones.
    ///
    /// Errors: as [`Self::realistic`].
    pub fn apply(&self, model: &mut Qwen4Exp) -> anyhow::Result<(Option<Arc<RealisticRouting>>, Arc<RoutingLog>)> {
        let shape = model.routing_shape();
        let realistic = self.realistic(shape)?;
        if let Some(r) = &realistic {
            model.set_routing_override(Some(r.clone()))?;
        }
        let log = RoutingLog::new(shape.n_layer, shape.n_expert);
        model.set_routing_log(Some(log.clone()));
        print_routing(realistic.as_deref());
        Ok((realistic, log))
    }
}

/// The line saying which routing a benchmark runs (and the realistic one's fit).
pub(crate) fn print_routing(realistic: Option<&RealisticRouting>) {
    match realistic {
        None => println!("routing: independent (the model's own routers)"),
        Some(r) => {
            let real = RoutingShape { n_layer: 48, n_expert: 512, top_k: 10 };
            let fit = RealisticRouting::new(real, r.seed()).map(|f| fitted_figures(&f, 32));
            println!(
                "routing: realistic (seed {}); its figures for a {}-token prompt and a {}-token answer at the real \
                 model's 48 x 512, top-10 (32 conversations): {}",
                r.seed(),
                nebula_engine::synth::routing::FIT_PROMPT,
                nebula_engine::synth::routing::FIT_ANSWER,
                fit.map_or_else(|e| e.to_string(), |f| f.summary())
            );
        }
    }
}

/// The routing statistics of the decode steps of stream `stream` at `positions`: from the realistic routing when
/// it runs (every backend uses exactly its rows), else what the host saw (`seen`).
pub(crate) fn decode_routing(
    realistic: Option<&RealisticRouting>,
    seen: Option<&RoutingStats>,
    stream: u64,
    positions: std::ops::Range<usize>,
) -> Option<RoutingStats> {
    match realistic {
        Some(r) => Some(r.stats(stream, positions)),
        None => seen.cloned(),
    }
}

/// The backend of a benchmark: `kind` on GPU `gpu`, its VRAM budget from the flag or else the emulated profile's.
pub(crate) fn bench_backend(
    kind: BackendKind,
    gpu: usize,
    placement: &crate::placement::PlacementConfig,
) -> BackendKind {
    match kind {
        BackendKind::Cuda { vram_budget, .. } => BackendKind::Cuda {
            device: gpu,
            vram_budget: vram_budget.or(placement.vram_budget_gib.map(|g| (g * (1u64 << 30) as f64) as u64)),
        },
        other => other,
    }
}

/// The tuning of a benchmark run: the defaults with the `NEBULA_*` variables (docs/config.md), read once here;
/// the CPU part is put in effect for the process before any model loads.
pub(crate) fn tuning_from_env() -> anyhow::Result<nebula_engine::tuning::Tuning> {
    let tuning = nebula_engine::tuning::Tuning::from_env()?;
    nebula_engine::tuning::install_cpu(tuning.cpu.clone());
    Ok(tuning)
}

/// Runs `nebula bench model`.
pub fn run_model(args: BenchModelArgs) -> anyhow::Result<()> {
    let mut tuning = tuning_from_env()?;
    let kv = crate::kv::resolve(args.profile.as_deref(), args.kv_cache_type, args.kv_window)?;
    if let Some(w) = kv.window {
        tuning.cuda.kv_window = w;
    }
    let placement = crate::placement::resolve(args.profile.as_deref(), &args.placement).map_err(anyhow::Error::msg)?;
    if let Some(threads) = placement.threads {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().context("setting the compute threads")?;
    }
    let t = std::time::Instant::now();
    let mut model = match &args.model {
        Some(p) => Qwen4Exp::load(p).with_context(|| format!("loading {}", p.display()))?,
        None => {
            let f = nebula_engine::gguf::GgufFile::from_bytes(
                "embedded demo model",
                crate::config::EMBEDDED_DEMO_MODEL.to_vec(),
            )?;
            Qwen4Exp::from_gguf(std::sync::Arc::new(f))?
        }
    };
    model.set_kv_cache(kv.cache_type)?;
    let cfg = model.config.clone();
    let (dense, experts, table) = model.weight_bytes();
    // The floor is a plain decode step's: without the MTP block, which `bench model` never drafts with.
    let dense = dense.saturating_sub(model.mtp_weight_bytes());
    let source = args.profile.as_ref().map_or("flags".to_owned(), |p| format!("profile {}", p.display()));
    if let Some(opts) = placement.to_options(&source).map_err(anyhow::Error::msg)? {
        // On CUDA a placement makes the run hybrid: GPU-tier experts on the GPU, the rest computed by the CPU.
        model.place(&opts).context("placing the experts")?;
        println!("{}", model.placement_report().summary());
    }
    let stats = model.placement_stats();
    let (realistic, log) = args.routing.apply(&mut model)?;
    let runner =
        Loaded::new(std::sync::Arc::new(model), bench_backend(args.backend, args.gpu, &placement), &tuning.cuda)?;
    println!("model: {} layers, loaded on {} in {:.1} s", cfg.n_layer, runner.describe(), t.elapsed().as_secs_f64());
    println!(
        "KV cache: {} ({} bytes a token per attention layer for K and V), {}",
        cfg.kv_cache,
        2 * cfg.attention_row_bytes(0)[0],
        match runner.cuda().map(|m| m.kv_window()) {
            Some(0) | None => "every token in VRAM".to_owned(),
            Some(w) => format!("hot window of {w} tokens in VRAM, the rest in pinned host memory"),
        }
    );
    let per_expert = experts / (cfg.n_layer * cfg.n_expert) as u64;
    let bw = runner.cuda().map(|m| m.copy_bandwidth(1 << 30)).transpose()?;
    if let Some(bw) = bw {
        println!("device copy bandwidth (read + write): {:.0} GB/s", bw / 1e9);
    }
    println!(
        "weights: dense {:.2} GiB, experts {:.2} GiB ({} each), n-gram table {:.2} GiB",
        dense as f64 / (1u64 << 30) as f64,
        experts as f64 / (1u64 << 30) as f64,
        if per_expert >= 1 << 20 {
            format!("{:.2} MiB", per_expert as f64 / (1u64 << 20) as f64)
        } else {
            format!("{:.1} KiB", per_expert as f64 / 1024.0)
        },
        table as f64 / (1u64 << 30) as f64
    );
    let rows = runner.run(ModelBench(BenchOptions {
        contexts: args.contexts.clone(),
        decode_tokens: args.decode,
        prefill_chunk: args.prefill_chunk,
        seed: 7,
        routing_log: Some(log),
    }))?;
    println!(
        "{:>8} {:>12} {:>10} {:>11} {:>9} {:>12} {:>9}",
        "context", "prefill t/s", "TTFT ms", "decode t/s", "ms/token", "bytes/token", "of floor"
    );
    for r in &rows {
        let b = decode_bytes(&cfg, dense, per_expert, r.context);
        let floor = bw.map(|bw| {
            // The copy figure counts read + write; a decode step only reads.
            let read_bw = bw / 2.0 * 2.0;
            let floor_s = b.total() as f64 / read_bw;
            format!("{:.0} %", floor_s / (r.decode_ms / 1e3) * 100.0)
        });
        println!(
            "{:>8} {:>12.0} {:>10.1} {:>11.1} {:>9.3} {:>10.0} MB {:>9}",
            r.context,
            r.prefill_tok_s,
            r.ttft_ms,
            r.decode_tok_s,
            r.decode_ms,
            b.total() as f64 / 1e6,
            floor.unwrap_or_else(|| "-".into())
        );
    }
    for r in &rows {
        let (stream, positions) = r.decode_rows.clone();
        let label = format!("routing of the decode at {} ({} steps)", r.context, positions.len());
        match decode_routing(realistic.as_deref(), r.routing.as_ref(), stream, positions) {
            Some(st) => println!("{label}: {}", st.summary(25)),
            None => println!("{label}: not seen by the host (the router's choice stays on the GPU)"),
        }
    }
    if let Some(m) = runner.cuda()
        && m.is_hybrid()
    {
        // The floor of hybrid decode: CPU expert bytes / DRAM read bandwidth + the GPU's share + one
        // round trip per layer, each measured here.
        let threads = rayon::current_num_threads();
        let dram = nebula_engine::bench::dram_read_bandwidth(threads, 1 << 30, 1.0)?;
        let rtt = m.round_trip()?;
        // The SSD tier's read bandwidth (whole experts through its reader and I/O threads), when there is one.
        let ssd = runner.ssd_read_bandwidth(1.0).transpose()?;
        println!(
            "hybrid: DRAM read {:.1} GB/s ({threads} threads), host-GPU-host round trip {:.1} us, expert {:.2} MiB{}; \
             batches up to {} tokens use the CPU for non-resident experts, longer ones stream them",
            dram / 1e9,
            rtt * 1e6,
            per_expert as f64 / (1u64 << 20) as f64,
            ssd.map_or(String::new(), |b| format!(", SSD tier read {:.2} GB/s", b / 1e9)),
            m.hybrid_params().map_or(0, |p| p.cpu_max_tokens)
        );
        if let Some(c) = m.gpu_cache() {
            println!(
                "GPU expert cache: {}{}",
                c.policy.name(),
                if c.policy == nebula_engine::placement::GpuCachePolicy::Static {
                    " (the placement's GPU tier throughout)".to_owned()
                } else {
                    format!(" (a refresh every {} passes, up to {} uploads per layer)", c.interval, c.uploads)
                }
            );
        }
        println!(
            "{:>8} {:>10} {:>10} {:>8} {:>10} {:>10} {:>8} {:>10} {:>10} {:>10} {:>9} {:>10} {:>9}",
            "context",
            "CPU exp/t",
            "GPU exp/t",
            "GPU hit",
            "uploads/t",
            "SSD rd/t",
            "handoff",
            "CPU ms/t",
            "GPU ms/t",
            "wait ms/t",
            "trips/t",
            "floor ms",
            "of floor"
        );
        for r in &rows {
            if let Some(h) = r.hybrid {
                // Floor: the CPU's expert bytes at the measured DRAM read bandwidth (the SSD reads a step needed at
                // the SSD tier's measured bandwidth instead), the GPU's critical-path work (CUDA events) and one
                // measured round trip per layer, in series (each layer's GPU work needs the previous layer's CPU
                // result).
                let (ssd_needed, ssd_s) = match ssd {
                    Some(b) if b > 0.0 => (h.ssd_needed.min(h.cpu_experts), per_expert as f64 / b),
                    _ => (0.0, 0.0),
                };
                let floor_ms = ((h.cpu_experts - ssd_needed) * per_expert as f64 / dram + ssd_needed * ssd_s) * 1e3
                    + h.gpu_ms
                    + h.trips * rtt * 1e3;
                let hit = h.gpu_experts / (h.gpu_experts + h.cpu_experts).max(1e-9) * 100.0;
                println!(
                    "{:>8} {:>10.1} {:>10.1} {:>7.1}% {:>10.1} {:>10.1} {:>8.1} {:>10.3} {:>10.3} {:>10.3} {:>9.0} {:>10.3} \
                     {:>8.0} %",
                    r.context,
                    h.cpu_experts,
                    h.gpu_experts,
                    hit,
                    h.cache_uploads,
                    h.ssd_reads,
                    h.handoffs,
                    h.cpu_ms,
                    h.gpu_ms,
                    h.wait_ms,
                    h.trips,
                    floor_ms,
                    floor_ms / r.decode_ms * 100.0
                );
            }
        }
    }
    if let Some(t) = nebula_engine::quant::moe::trace::report() {
        println!("{t} (NEBULA_CPU_MOE_TRACE=1, every call of the run)");
    }
    {
        // Every frontier's decode steps together.
        let mut prof: Vec<(&str, f64, u64)> = Vec::new();
        for (name, secs, count) in rows.iter().flat_map(|r| r.decode_phases.iter()) {
            match prof.iter_mut().find(|p| p.0 == *name) {
                Some(p) => {
                    p.1 += secs;
                    p.2 += count;
                }
                None => prof.push((name, *secs, *count)),
            }
        }
        if !prof.is_empty() {
            let total: f64 = prof.iter().map(|p| p.1).sum();
            println!("phase breakdown (NEBULA_CUDA_PROFILE=1, stream synchronised after each phase, all runs):");
            for (name, secs, count) in prof {
                println!("  {name:<20} {:>9.1} ms {:>5.1} %  ({count} times)", secs * 1e3, secs / total * 100.0);
            }
        }
    }
    for r in &rows {
        if let Some(c) = &r.prefill_copies {
            println!("prefill of {} tokens: {c}", r.context);
        }
        if !r.prefill_phases.is_empty() {
            let total: f64 = r.prefill_phases.iter().map(|p| p.1).sum();
            println!("prefill of {} tokens, phases (stream synchronised after each):", r.context);
            for (name, secs, count) in &r.prefill_phases {
                println!("  {name:<20} {:>9.1} ms {:>5.1} %  ({count} times)", secs * 1e3, secs / total * 100.0);
            }
        }
        let mut kt = r.prefill_kernels.clone();
        if kt.is_empty() {
            continue;
        }
        kt.sort_by(|a, b| b.1.total_cmp(&a.1));
        let total: f64 = kt.iter().map(|k| k.1).sum();
        println!(
            "prefill of {} tokens, kernels by time (synchronised around each launch; cuBLAS not counted):",
            r.context
        );
        for (name, secs, count) in kt.iter().take(12) {
            println!(
                "  {name:<24} {:>9.2} ms {:>5.1} %  {count:>6} launches, {:>8.1} us each",
                secs * 1e3,
                secs / total * 100.0,
                secs * 1e6 / *count as f64
            );
        }
    }
    if let Some(last) = rows.last() {
        let mut kt = last.decode_kernels.clone();
        if !kt.is_empty() {
            kt.sort_by(|a, b| b.1.total_cmp(&a.1));
            let total: f64 = kt.iter().map(|k| k.1).sum();
            println!(
                "decode kernels by time (NEBULA_CUDA_PROFILE=kernels, synchronised around each launch, last frontier):"
            );
            for (name, secs, count) in kt.iter().take(20) {
                println!(
                    "  {name:<24} {:>9.2} ms {:>5.1} %  {count:>6} launches, {:>8.1} us each",
                    secs * 1e3,
                    secs / total * 100.0,
                    secs * 1e6 / *count as f64
                );
            }
        }
    }
    let s = stats.snapshot();
    if s.cache_uploads > 0 {
        println!("GPU expert cache over the run: {} experts uploaded", s.cache_uploads);
    }
    let uses = (s.expert_hits_gpu + s.expert_hits_ram + s.expert_hits_ssd).max(1) as f64;
    if s.expert_hits_ssd > 0 || s.expert_hits_gpu > 0 {
        println!(
            "expert uses by tier over the run: GPU {:.1} %, RAM {:.1} %, SSD {:.1} %; SSD read {:.1} MiB in {} expert \
             reads ({} errors), prefetched {} of which {} used (prefetch gate closed {} times); n-gram rows read {}",
            s.expert_hits_gpu as f64 / uses * 100.0,
            s.expert_hits_ram as f64 / uses * 100.0,
            s.expert_hits_ssd as f64 / uses * 100.0,
            s.ssd_expert_bytes as f64 / (1u64 << 20) as f64,
            s.ssd_expert_reads,
            s.ssd_read_errors,
            s.prefetch_issued,
            s.prefetch_hits,
            s.prefetch_gate_closed,
            s.ngram_rows_read
        );
    }
    if let Some(path) = &args.csv {
        let mut f = std::fs::File::create(path)?;
        writeln!(f, "{}", BenchRow::CSV_HEADER)?;
        for r in &rows {
            writeln!(f, "{}", r.csv())?;
        }
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// Arguments of `nebula bench mtp`.
#[derive(clap::Args, Debug)]
pub struct BenchMtpArgs {
    /// GGUF model (default: the embedded demo model). A model without an MTP block gets a random one appended
    /// (in a temporary file): the MTP's own acceptance is then meaningless, the `rate` rows are not.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Random prompt tokens prefilled before each run.
    #[arg(long, default_value_t = 256)]
    pub prompt: usize,
    /// Tokens decoded per run.
    #[arg(long, default_value_t = 128)]
    pub tokens: usize,
    /// Accuracy levels run with the model's own drafts, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "3,2,1")]
    pub levels: Vec<i64>,
    /// Acceptance rates of the scripted test drafter, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "0.5,0.7,0.9")]
    pub rates: Vec<f64>,
    /// Write the rows as CSV here.
    #[arg(long)]
    pub csv: Option<PathBuf>,
    /// Chain lengths whose verify pass is timed alone against a plain step and a draft step (median of
    /// `--pass-repeats`), comma separated; empty: none.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub pass_rows: Vec<usize>,
    /// Repeats of each timed pass.
    #[arg(long, default_value_t = 9)]
    pub pass_repeats: usize,
    /// cpu or cuda (the GPU model: all-GPU, or hybrid with a placement, drafting with the MTP block on the GPU).
    #[arg(long, default_value = "cpu")]
    pub backend: BackendKind,
    /// GPU index for the cuda backend.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Hardware profile file to emulate (as `nebula bench model --profile`); the placement flags override it.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Expert placement and emulation.
    #[command(flatten)]
    pub placement: crate::placement::PlacementFlags,
    /// Routing.
    #[command(flatten)]
    pub routing: RoutingFlags,
}

/// Runs `nebula bench mtp`.
pub fn run_mtp(args: BenchMtpArgs) -> anyhow::Result<()> {
    use nebula_engine::speculative::AccuracyLevel;
    let levels = args
        .levels
        .iter()
        .map(|&l| AccuracyLevel::from_number(l).with_context(|| format!("accuracy level {l} is not 1, 2 or 3")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if let Some(r) = args.rates.iter().find(|r| !(0.0..=1.0).contains(*r)) {
        anyhow::bail!("acceptance rate {r} is not within [0, 1]");
    }
    if args.tokens == 0 {
        anyhow::bail!("--tokens must be at least 1 (tokens decoded per run)");
    }
    let tuning = tuning_from_env()?;
    let tmp = tempfile_dir()?;
    // The temporary models go whatever happens below (a failed GPU load included).
    let out = run_mtp_in(&args, levels, &tmp, &tuning.cuda);
    let _ = std::fs::remove_dir_all(&tmp);
    out
}

/// [`run_mtp`] with the temporary folder `tmp` for the models it writes.
fn run_mtp_in(
    args: &BenchMtpArgs,
    levels: Vec<nebula_engine::speculative::AccuracyLevel>,
    tmp: &std::path::Path,
    cuda_tuning: &nebula_engine::tuning::CudaTuning,
) -> anyhow::Result<()> {
    let source = match &args.model {
        Some(p) => p.clone(),
        None => {
            let p = tmp.join("nebula-demo.gguf");
            std::fs::write(&p, crate::config::EMBEDDED_DEMO_MODEL).context("writing the embedded demo model")?;
            p
        }
    };
    let placement = crate::placement::resolve(args.profile.as_deref(), &args.placement).map_err(anyhow::Error::msg)?;
    if let Some(threads) = placement.threads {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().context("setting the compute threads")?;
    }
    let t = std::time::Instant::now();
    let mut model = Qwen4Exp::load(&source).with_context(|| format!("loading {}", source.display()))?;
    if model.mtp().is_none() {
        let with = tmp.join("with-mtp.gguf");
        nebula_engine::synth::append_random_mtp(&source, &with, 1)
            .with_context(|| format!("appending a random MTP block to {}", source.display()))?;
        model = Qwen4Exp::load(&with)?;
        println!(
            "note: {} has no MTP block; a random one was appended (its own acceptance is meaningless)",
            source.display()
        );
    }
    let source_name = args.profile.as_ref().map_or("flags".to_owned(), |p| format!("profile {}", p.display()));
    if let Some(opts) = placement.to_options(&source_name).map_err(anyhow::Error::msg)? {
        model.place(&opts).context("placing the experts")?;
        println!("{}", model.placement_report().summary());
    }
    let cfg = model.config.clone();
    let (realistic, _log) = args.routing.apply(&mut model)?;
    let runner =
        Loaded::new(std::sync::Arc::new(model), bench_backend(args.backend, args.gpu, &placement), cuda_tuning)?;
    println!(
        "model: {} layers + MTP, vocab {}, loaded on {} in {:.1} s; {} CPU threads; prompt {} tokens, {} decoded per run",
        cfg.n_layer,
        cfg.vocab,
        runner.describe(),
        t.elapsed().as_secs_f64(),
        rayon::current_num_threads(),
        args.prompt,
        args.tokens
    );
    println!(
        "{:<16} {:>8} {:>7} {:>7} {:>7} {:>11} {:>6} {:>7} {:>7} {:>8} {:>7} {:>7} {:>7}",
        "run",
        "tok/s",
        "speedup",
        "accept",
        "mean len",
        "chains A/B/C",
        "coll.",
        "draft%",
        "verify%",
        "rollbk%",
        "align%",
        "exact%",
        "plain%"
    );
    let opts = MtpBenchOptions {
        prompt_tokens: args.prompt,
        decode_tokens: args.tokens,
        levels,
        rates: args.rates.clone(),
        pass_rows: args.pass_rows.clone(),
        ..Default::default()
    };
    let print = |r: &MtpBenchRow| {
        let p = &r.report;
        let pct = |x: f64| x / r.decode_s.max(1e-12) * 100.0;
        println!(
            "{:<16} {:>8.1} {:>6.2}x {:>6.1}% {:>8.2} {:>11} {:>6} {:>6.1}% {:>6.1}% {:>7.1}% {:>6.1}% {:>6.1}% {:>6.1}%",
            r.label,
            r.tok_s,
            r.speedup,
            p.acceptance_rate() * 100.0,
            p.mean_accepted_length(),
            format!("{}/{}/{}", p.chains[0], p.chains[1], p.chains[2]),
            p.collapses,
            pct(p.draft_s),
            pct(p.verify_s),
            pct(p.save_s + p.restore_s),
            pct(p.realign_s),
            pct(p.exact_s),
            pct(p.plain_s)
        );
    };
    let (rows, costs) = runner.run(MtpBench { opts: &opts, repeats: args.pass_repeats, print })?;
    if !costs.is_empty() {
        println!("one pass alone (median of {}), at position {}:", args.pass_repeats, args.prompt);
        println!(
            "{:>5} {:>10} {:>10} {:>8} {:>11} {:>10}",
            "rows", "verify ms", "step ms", "steps", "rollback ms", "draft ms"
        );
        for c in &costs {
            println!(
                "{:>5} {:>10.3} {:>10.3} {:>8.2} {:>11.3} {:>10.3}",
                c.rows,
                c.verify_s * 1e3,
                c.step_s * 1e3,
                c.verify_s / c.step_s.max(1e-12),
                c.rollback_s * 1e3,
                c.draft_s * 1e3
            );
        }
    }
    if let Some(r) = &realistic {
        // Every run decodes the same positions of the same prompt's stream: one routing for all of them.
        let (stream, positions) = opts.decode_rows(cfg.vocab);
        println!(
            "routing of every run's decode ({} positions): {}",
            positions.len(),
            r.stats(stream, positions).summary(25)
        );
    } else {
        println!("routing: the routers' choices of the runs are not collected here (bench model reports them)");
    }
    if let Some(path) = &args.csv {
        let mut f = std::fs::File::create(path)?;
        writeln!(f, "{}", MtpBenchRow::CSV_HEADER)?;
        for r in &rows {
            writeln!(f, "{}", r.csv())?;
        }
    }
    Ok(())
}

/// A private temporary folder.
fn tempfile_dir() -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("nebula-bench-mtp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// `nebula bench model` on whichever backend was loaded.
struct ModelBench(BenchOptions);

impl WithBackend for ModelBench {
    type Output = Result<Vec<nebula_engine::bench::BenchRow>, BackendError>;
    fn run<B: Backend>(self, backend: &B) -> Self::Output {
        run(backend, &self.0)
    }
}

/// `nebula bench mtp` on whichever backend was loaded, printing each row as it finishes.
/// Then times single passes ([`pass_costs`]).
struct MtpBench<'a, F> {
    opts: &'a MtpBenchOptions,
    repeats: usize,
    print: F,
}

impl<F: FnMut(&MtpBenchRow)> WithBackend for MtpBench<'_, F> {
    type Output = Result<(Vec<MtpBenchRow>, Vec<PassCost>), BackendError>;
    fn run<B: Backend>(self, backend: &B) -> Self::Output {
        let rows = run_mtp_bench(backend, self.opts, self.print)?;
        let costs = pass_costs(backend, self.opts.prompt_tokens, &self.opts.pass_rows, self.repeats, self.opts.seed)?;
        Ok((rows, costs))
    }
}
