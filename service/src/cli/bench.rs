//! `nebula bench model`.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use nebula_engine::backend::{BackendKind, Runner};
use nebula_engine::bench::{BenchOptions, BenchRow, decode_bytes, run};
use nebula_engine::model::Qwen4Exp;

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
}

/// Runs `nebula bench model`.
pub fn run_model(args: BenchModelArgs) -> anyhow::Result<()> {
    let t = std::time::Instant::now();
    let model = match &args.model {
        Some(p) => Qwen4Exp::load(p).with_context(|| format!("loading {}", p.display()))?,
        None => {
            let f = nebula_engine::gguf::GgufFile::from_bytes(
                "embedded demo model",
                crate::config::EMBEDDED_DEMO_MODEL.to_vec(),
            )?;
            Qwen4Exp::from_gguf(std::sync::Arc::new(f))?
        }
    };
    let cfg = model.config.clone();
    let (dense, experts, table) = model.weight_bytes();
    let backend = match args.backend {
        BackendKind::Cuda { vram_budget, .. } => BackendKind::Cuda { device: args.gpu, vram_budget },
        other => other,
    };
    let runner = Runner::new(model, backend)?;
    println!("model: {} layers, loaded on {} in {:.1} s", cfg.n_layer, runner.describe(), t.elapsed().as_secs_f64());
    let per_expert = experts / (cfg.n_layer * cfg.n_expert) as u64;
    let bw = match &runner {
        Runner::Cuda(m) => Some(m.copy_bandwidth(1 << 30)?),
        Runner::Cpu(_) => None,
    };
    if let Some(bw) = bw {
        println!("device copy bandwidth (read + write): {:.0} GB/s", bw / 1e9);
    }
    println!(
        "weights: dense {:.2} GiB, experts {:.2} GiB ({:.2} MiB each), n-gram table {:.2} GiB",
        dense as f64 / (1u64 << 30) as f64,
        experts as f64 / (1u64 << 30) as f64,
        per_expert as f64 / (1u64 << 20) as f64,
        table as f64 / (1u64 << 30) as f64
    );
    let rows = run(
        &runner,
        &BenchOptions {
            contexts: args.contexts.clone(),
            decode_tokens: args.decode,
            prefill_chunk: args.prefill_chunk,
            seed: 7,
        },
    )?;
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
    if let Runner::Cuda(m) = &runner {
        let prof = m.take_profile();
        if !prof.is_empty() {
            let total: f64 = prof.iter().map(|p| p.1).sum();
            println!("phase breakdown (NEBULA_CUDA_PROFILE=1, stream synchronised after each phase, all runs):");
            for (name, secs, count) in prof {
                println!("  {name:<20} {:>9.1} ms {:>5.1} %  ({count} times)", secs * 1e3, secs / total * 100.0);
            }
        }
    }
    if let Runner::Cuda(m) = &runner {
        let mut kt = m.take_kernel_times();
        if !kt.is_empty() {
            kt.sort_by(|a, b| b.1.total_cmp(&a.1));
            let total: f64 = kt.iter().map(|k| k.1).sum();
            println!("kernels by time (NEBULA_CUDA_PROFILE=kernels, synchronised around each launch, all runs):");
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
