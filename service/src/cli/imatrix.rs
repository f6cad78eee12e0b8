//! `nebula imatrix`: an importance matrix for `nebula convert --imatrix` (and for llama.cpp's `llama-quantize`),
//! gathered by running the CPU model over a calibration text as llama.cpp's `llama-imatrix` does: the text is
//! tokenized as plain text (no special-token matching, no BOS for Qwen vocabularies), cut into chunks of `--ctx`
//! tokens, and each chunk runs from an empty state (`engine/src/convert/imatrix.rs`, `ImatrixCollector`).

use std::path::PathBuf;

use anyhow::{Context, bail};
use nebula_engine::convert::ImatrixCollector;
use nebula_engine::gguf::GgufFile;
use nebula_engine::model::Qwen4Exp;
use nebula_engine::text::tokenizer::{GgufVocab, TextTokenizer};

/// Arguments of `nebula imatrix`.
#[derive(clap::Args, Debug)]
pub struct ImatrixArgs {
    /// GGUF model (F32/BF16/F16 or Q8_0 gives the truest statistics).
    #[arg(long)]
    pub model: PathBuf,
    /// Calibration text (UTF-8).
    #[arg(long, short = 'f')]
    pub text: PathBuf,
    /// Output importance matrix (llama.cpp's GGUF format).
    #[arg(long, short = 'o')]
    pub output: PathBuf,
    /// Tokens per chunk (each chunk runs from an empty state).
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Chunks to run at most (default: all the text gives).
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Also collect the output head's inputs (`llama-imatrix --process-output`).
    #[arg(long)]
    pub process_output: bool,
}

/// Runs `nebula imatrix`.
pub fn run(args: ImatrixArgs) -> anyhow::Result<()> {
    if args.ctx == 0 {
        bail!("--ctx must be at least 1");
    }
    let text = std::fs::read_to_string(&args.text).with_context(|| format!("reading {}", args.text.display()))?;
    let file =
        std::sync::Arc::new(GgufFile::open(&args.model).with_context(|| format!("opening {}", args.model.display()))?);
    let vocab = GgufVocab::from_gguf(&file)?.context("the model has no tokenizer")?;
    let tok = TextTokenizer::from_gguf_vocab(&vocab)?;
    let model = Qwen4Exp::from_gguf(file)?;
    let ids = tok.encode_plain(&text)?;
    let all = ids.len() / args.ctx;
    let n = args.chunks.map_or(all, |c| c.min(all));
    if n == 0 {
        bail!("{} has {} tokens, fewer than one chunk of --ctx {}", args.text.display(), ids.len(), args.ctx);
    }
    let chunks: Vec<&[u32]> = ids.chunks_exact(args.ctx).take(n).collect();
    let collector = ImatrixCollector::new(&model, args.process_output);
    let t = std::time::Instant::now();
    let tokens = collector.run(&model, &chunks)?;
    let dataset = args.text.file_name().map_or_else(|| args.text.display().to_string(), |f| f.to_string_lossy().into());
    collector
        .write_gguf(&args.output, &dataset, n as u32, args.ctx as u32)
        .with_context(|| format!("writing {}", args.output.display()))?;
    println!(
        "{} chunks of {} tokens ({tokens} tokens) in {:.1} s: {} entries written to {}{}",
        n,
        args.ctx,
        t.elapsed().as_secs_f64(),
        collector.entries(),
        args.output.display(),
        match collector.unmatched() {
            0 => String::new(),
            u => format!(" ({u} products on weights outside the file were not recorded)"),
        }
    );
    Ok(())
}
