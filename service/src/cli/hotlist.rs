//! `nebula hotlist`: runs the routing campaign over a prompt set and writes the hotlist file (format:
//! `nebula_engine::placement::hotlist`), then prints how concentrated the routing was.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use nebula_engine::gguf::GgufFile;
use nebula_engine::model::Qwen4Exp;
use nebula_engine::placement::campaign::{CampaignOptions, DEFAULT_PROMPT_SET, parse_prompt_set, run_campaign};
use nebula_engine::text::chat_template::{ChatTemplate, QWEN38_CHAT_TEMPLATE};
use nebula_engine::text::tokenizer::{GgufVocab, TextTokenizer};

/// Arguments of `nebula hotlist`.
#[derive(clap::Args, Debug)]
pub struct HotlistArgs {
    /// GGUF model (split files: the first part). Default: the embedded demo model.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Prompt set (JSON Lines: {"domain", "messages"}). Default: the committed assets/hotlist/prompts.jsonl.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Where to write the hotlist.
    #[arg(short, long, default_value = "hotlist.json")]
    pub out: PathBuf,
    /// Greedy tokens generated after each prompt (their routing counts too).
    #[arg(long, default_value_t = 16)]
    pub generate: usize,
    /// Render the prompts with thinking on (default: off, as most served requests).
    #[arg(long)]
    pub thinking: bool,
    /// Use only the first N prompts (quick runs).
    #[arg(long)]
    pub limit: Option<usize>,
}

/// Runs `nebula hotlist`.
pub fn run(args: HotlistArgs) -> anyhow::Result<()> {
    let t = std::time::Instant::now();
    let file = match &args.model {
        Some(p) => GgufFile::open(p).with_context(|| format!("opening {}", p.display()))?,
        None => GgufFile::from_bytes("embedded demo model", crate::config::EMBEDDED_DEMO_MODEL.to_vec())
            .context("reading the embedded demo model (a `lean` build has none: pass --model)")?,
    };
    let file = Arc::new(file);
    let vocab = GgufVocab::from_gguf(&file)?.context("the model has no tokenizer")?;
    let tokenizer = TextTokenizer::from_gguf_vocab(&vocab)?;
    let template = match file.get_str_opt("tokenizer.chat_template").ok().flatten() {
        Some(src) => ChatTemplate::new(src)?,
        None => {
            eprintln!("the model has no chat template: using the official Qwen3.8 one");
            ChatTemplate::new(QWEN38_CHAT_TEMPLATE)?
        }
    };
    let name = file.get_str_opt("general.name").ok().flatten().unwrap_or("model").to_owned();
    let stop_tokens: Vec<u32> =
        ["<|im_end|>", "<|endoftext|>"].iter().filter_map(|s| tokenizer.token_to_id(s)).collect();
    let model = Qwen4Exp::from_gguf(file)?;
    let (text, label) = match &args.prompts {
        Some(p) => {
            (std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?, p.display().to_string())
        }
        None => (DEFAULT_PROMPT_SET.to_owned(), "assets/hotlist/prompts.jsonl (embedded)".to_owned()),
    };
    let mut prompts = parse_prompt_set(&text).map_err(|e| anyhow::anyhow!("prompt set {label}: {e}"))?;
    if let Some(n) = args.limit {
        prompts.truncate(n.max(1));
    }
    let opts = CampaignOptions {
        generate: args.generate,
        enable_thinking: Some(args.thinking),
        chunk: 512,
        prompt_set_label: label,
        stop_tokens,
    };
    println!(
        "model: {name} ({} layers x {} experts, top {}), {} prompts",
        model.config.n_layer,
        model.config.n_expert,
        model.config.n_expert_used,
        prompts.len()
    );
    let total = prompts.len();
    let hotlist = run_campaign(&model, &tokenizer, &template, &name, &prompts, &opts, |done, tokens| {
        if done % 16 == 0 || done == total {
            eprintln!("  {done}/{total} prompts, {tokens} tokens, {:.0} s", t.elapsed().as_secs_f64());
        }
    })
    .map_err(|e| anyhow::anyhow!(e))?;
    std::fs::write(&args.out, hotlist.to_json()).with_context(|| format!("writing {}", args.out.display()))?;
    let n = model.config.n_expert;
    let shares: Vec<String> = [n / 16, n / 8, n / 4, n / 2]
        .iter()
        .filter(|&&k| k > 0)
        .map(|&k| {
            let mean = (0..hotlist.layers.len()).map(|l| hotlist.coverage(l, k)).sum::<f64>()
                / hotlist.layers.len().max(1) as f64;
            format!("top {k}: {:.0} %", mean * 100.0)
        })
        .collect();
    println!(
        "wrote {} ({} tokens in {:.1} s); routed uses held by the hottest experts, mean over layers: {}",
        args.out.display(),
        hotlist.campaign["tokens"],
        t.elapsed().as_secs_f64(),
        shares.join(", ")
    );
    Ok(())
}
