//! `nebula generate`: greedy continuation of a text prompt (no chat template), for comparing engines token by
//! token (e.g. against llama.cpp's `llama-simple` on the same GGUF).

use std::path::PathBuf;

use anyhow::Context;
use nebula_engine::backend::{BackendKind, Runner};
use nebula_engine::gguf::GgufFile;
use nebula_engine::model::{LogitsFor, Qwen4Exp};
use nebula_engine::sampling::argmax;
use nebula_engine::text::tokenizer::{GgufVocab, TextTokenizer};

/// Arguments of `nebula generate`.
#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// GGUF model.
    #[arg(long)]
    pub model: PathBuf,
    /// cpu or cuda.
    #[arg(long, default_value = "cpu")]
    pub backend: BackendKind,
    /// The prompt text (tokenized as is, no chat template, no BOS).
    #[arg(long)]
    pub prompt: String,
    /// Tokens to generate greedily.
    #[arg(short, long, default_value_t = 16)]
    pub n: usize,
}

/// Runs `nebula generate`: prints the prompt ids, the generated ids and the generated text.
pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    // Tuning from the NEBULA_* variables (docs/config.md), read once before the model loads.
    let tuning = nebula_engine::tuning::Tuning::from_env()?;
    nebula_engine::tuning::install_cpu(tuning.cpu.clone());
    let file =
        std::sync::Arc::new(GgufFile::open(&args.model).with_context(|| format!("opening {}", args.model.display()))?);
    let vocab = GgufVocab::from_gguf(&file)?.context("the model has no tokenizer")?;
    let tok = TextTokenizer::from_gguf_vocab(&vocab)?;
    let model = Qwen4Exp::from_gguf(file)?;
    let runner = Runner::new(model, args.backend, &tuning.cuda)?;
    let prompt = tok.encode(&args.prompt)?;
    let mut st = runner.new_state(prompt.len() + args.n + 1)?;
    let mut logits = runner.forward(&mut st, &prompt, LogitsFor::Last)?;
    let mut out = Vec::new();
    for _ in 0..args.n {
        let t = argmax(&logits).context("no token possible")? as u32;
        out.push(t);
        logits = runner.forward(&mut st, &[t], LogitsFor::Last)?;
    }
    println!("backend: {}", runner.describe());
    println!("prompt ids: {prompt:?}");
    println!("generated ids: {out:?}");
    println!("generated text: {:?}", tok.decode(&out, false)?);
    Ok(())
}
