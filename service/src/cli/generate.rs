//! `nebula generate`: greedy continuation of a text prompt (no chat template), for comparing engines token by
//! token (e.g. against llama.cpp's `llama-simple` on the same GGUF).

use std::path::PathBuf;

use anyhow::Context;
use nebula_engine::backend::{Backend, BackendKind, Loaded, WithBackend};
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
    let runner = Loaded::new(std::sync::Arc::new(model), args.backend, &tuning.cuda)?;
    let prompt = tok.encode(&args.prompt)?;
    let out = runner.run(Greedy { prompt: &prompt, n: args.n })?;
    println!("backend: {}", runner.describe());
    println!("prompt ids: {prompt:?}");
    println!("generated ids: {out:?}");
    println!("generated text: {:?}", tok.decode(&out, false)?);
    Ok(())
}

/// Greedy continuation of `prompt` by `n` tokens on whichever backend was loaded.
struct Greedy<'a> {
    prompt: &'a [u32],
    n: usize,
}

impl WithBackend for Greedy<'_> {
    type Output = anyhow::Result<Vec<u32>>;
    fn run<B: Backend>(self, backend: &B) -> Self::Output {
        let mut st = backend.new_state(self.prompt.len() + self.n + 1, false)?;
        let mut logits = backend.forward(&mut st, self.prompt, LogitsFor::Last)?;
        let mut out = Vec::new();
        for _ in 0..self.n {
            let t = argmax(&logits).context("no token possible")? as u32;
            out.push(t);
            logits = backend.forward(&mut st, &[t], LogitsFor::Last)?;
        }
        Ok(out)
    }
}
