//! `nebula synth`.

use std::path::PathBuf;

use anyhow::Context;
use nebula_engine::gguf::GgufFile;
use nebula_engine::synth::{SynthOptions, SynthRecipe, synth};

/// Arguments of `nebula synth`.
#[derive(clap::Args, Debug)]
pub struct SynthArgs {
    /// Output GGUF path.
    #[arg(short, long)]
    pub out: PathBuf,
    /// Trunk layers (every 4th is attention).
    #[arg(long, default_value_t = 12)]
    pub layers: usize,
    /// Weight types: nebula-q4, q8_0 or bf16.
    #[arg(long, default_value = "nebula-q4")]
    pub recipe: SynthRecipe,
    /// Rows of each of the 16 n-gram hash heads.
    #[arg(long, default_value_t = 1 << 20)]
    pub ngram_rows: u64,
    /// Routed experts per layer.
    #[arg(long, default_value_t = 512)]
    pub experts: usize,
    /// Uniform routing instead of the real model's skew.
    #[arg(long)]
    pub no_skew: bool,
    /// Random seed.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Leave out the MTP block (written by default, as `nebula convert` writes a checkpoint's).
    #[arg(long)]
    pub no_mtp: bool,
    /// GGUF whose tokenizer and chat template are copied (default: the embedded demo model).
    #[arg(long)]
    pub tokenizer_from: Option<PathBuf>,
}

/// Runs `nebula synth`.
pub fn run(args: SynthArgs) -> anyhow::Result<()> {
    // Each token routes to 10 experts (the real model's top-k), so a layer needs at least that many.
    if args.experts < 10 {
        anyhow::bail!("--experts {} is below the 10 experts each token is routed to", args.experts);
    }
    if args.layers == 0 {
        anyhow::bail!("--layers must be at least 1");
    }
    let tok = match &args.tokenizer_from {
        Some(p) => GgufFile::open(p).with_context(|| format!("reading the tokenizer of {}", p.display()))?,
        None => GgufFile::from_bytes("embedded demo model", crate::config::EMBEDDED_DEMO_MODEL.to_vec())
            .context("reading the embedded demo model's tokenizer (a `lean` build has none: pass --tokenizer-from)")?,
    };
    let opts = SynthOptions {
        layers: args.layers,
        ngram_rows_per_head: args.ngram_rows,
        recipe: args.recipe,
        seed: args.seed,
        routing_skew: !args.no_skew,
        experts: args.experts,
        mtp: !args.no_mtp,
        ..Default::default()
    };
    let t = std::time::Instant::now();
    let report = synth(&args.out, &opts, &tok).with_context(|| format!("writing {}", args.out.display()))?;
    for f in &report.files {
        println!("wrote {}", f.display());
    }
    let s = report.fitted_shares;
    println!(
        "{:.2} GiB of tensor data in {:.1} s; router fit: top 32/64/128/256 experts carry {:.0}/{:.0}/{:.0}/{:.0} % of the routing mass (target 37/53/73/93)",
        report.data_bytes as f64 / (1u64 << 30) as f64,
        t.elapsed().as_secs_f64(),
        s[0] * 100.0,
        s[1] * 100.0,
        s[2] * 100.0,
        s[3] * 100.0
    );
    Ok(())
}
