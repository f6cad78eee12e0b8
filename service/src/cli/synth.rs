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
    /// Weight types: a `nebula convert --recipe` mix (nebula-q4, q8_0, ud-q4_k_xl, iq4_xs, q2_k, q3_k_s,
    /// q3_k_m, iq3_xxs, iq2_xs, iq1_m, ud-q2_k_xl; the with-imatrix choices) or bf16.
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
    /// Leave the n-gram table as a hole in the file (zeros: no disk, no write time; the n-gram embeddings are
    /// then zero). For full-depth files with the release's table (`--ngram-rows 20000000`).
    #[arg(long)]
    pub sparse_ngram: bool,
    /// GGUF whose tokenizer and chat template are copied (default: the embedded demo model).
    #[arg(long)]
    pub tokenizer_from: Option<PathBuf>,
    /// Also write a random vision tower for the model to this file, as an mmproj GGUF (F32, the released
    /// tower's shapes unless `--vision-depth` and `--vision-width` shrink it), for `nebula serve --mmproj` and
    /// `nebula bench vision`.
    #[arg(long)]
    pub mmproj: Option<PathBuf>,
    /// Blocks of the vision tower (with --mmproj).
    #[arg(long, default_value_t = 24)]
    pub vision_depth: usize,
    /// Width of the vision tower's blocks (with --mmproj; heads of 64, MLP 4x the width).
    #[arg(long, default_value_t = 1024)]
    pub vision_width: usize,
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
        sparse_ngram: args.sparse_ngram,
        ..Default::default()
    };
    let (total, hole) = nebula_engine::synth::planned_bytes(&opts);
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let dir = args.out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    if let Some(free) = nebula_engine::synth::free_disk_bytes(dir)
        && total - hole > free
    {
        anyhow::bail!(
            "{} needs {:.2} GiB of disk ({:.2} GiB of tensor data{}), {} has {:.2} GiB free",
            args.out.display(),
            gib(total - hole),
            gib(total),
            if hole > 0 { format!(", {:.2} GiB of it a hole", gib(hole)) } else { String::new() },
            dir.display(),
            gib(free)
        );
    }
    let t = std::time::Instant::now();
    if let Some(mm) = &args.mmproj {
        if args.vision_width == 0 || args.vision_width % 64 != 0 {
            anyhow::bail!("--vision-width {} is not a multiple of the 64-wide heads", args.vision_width);
        }
        let shape = nebula_engine::synth::vision::SynthVision {
            depth: args.vision_depth,
            hidden: args.vision_width,
            heads: args.vision_width / 64,
            intermediate: 4 * args.vision_width,
            ..nebula_engine::synth::vision::SynthVision::real(nebula_engine::synth::D)
        };
        for f in nebula_engine::synth::vision::synth_mmproj(mm, &shape, args.seed)
            .with_context(|| format!("writing {}", mm.display()))?
        {
            println!("wrote {} (vision tower, {:.0} M parameters)", f.display(), shape.parameters() as f64 / 1e6);
        }
    }
    let report = synth(&args.out, &opts, &tok).with_context(|| format!("writing {}", args.out.display()))?;
    for f in &report.files {
        println!("wrote {}", f.display());
    }
    let s = report.fitted_shares;
    println!(
        "{:.2} GiB of tensor data ({:.2} GiB written, {:.2} GiB left as a hole; {:.3} MiB per routed expert) in {:.1} s; router fit: top 32/64/128/256 experts carry {:.0}/{:.0}/{:.0}/{:.0} % of the routing mass (target 37/53/73/93)",
        gib(report.data_bytes),
        gib(report.data_bytes - report.sparse_bytes),
        gib(report.sparse_bytes),
        report.expert_bytes as f64 / (1u64 << 20) as f64,
        t.elapsed().as_secs_f64(),
        s[0] * 100.0,
        s[1] * 100.0,
        s[2] * 100.0,
        s[3] * 100.0
    );
    Ok(())
}
