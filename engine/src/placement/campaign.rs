//! The routing campaign behind `nebula hotlist`: every prompt of a prompt set is chat-templated with the model's
//! template, tokenized, prefilled, optionally continued greedily for a few tokens, and every layer's routing
//! decisions are counted ([`HotlistBuilder`]).
//!
//! Prompt set format (JSON Lines, one conversation per line; the committed one is
//! `assets/hotlist/prompts.jsonl`): `{"domain": "code-python", "messages": [{"role": "user", "content": "..."}]}`.
//! `messages` is an OpenAI-style list (system, user and assistant turns); `domain` groups prompts for the report.

use std::collections::BTreeSet;

use crate::model::{LogitsFor, ModelError, Qwen4Exp};
use crate::sampling::argmax;
use crate::text::chat_template::{ChatTemplate, RenderRequest};
use crate::text::tokenizer::TextTokenizer;

use super::hotlist::{Hotlist, HotlistBuilder, HotlistModel};

/// The prompt set committed with Nebula (144 conversations in 14 domains), embedded.
pub const DEFAULT_PROMPT_SET: &str = include_str!("../../../assets/hotlist/prompts.jsonl");

/// One conversation of a prompt set.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CampaignPrompt {
    /// Domain label.
    pub domain: String,
    /// OpenAI-style messages.
    pub messages: serde_json::Value,
}

/// Parses a prompt set (JSON Lines; blank lines skipped).
///
/// Errors: a message naming the line for a line that is not a prompt (bad JSON, no domain, empty messages).
pub fn parse_prompt_set(text: &str) -> Result<Vec<CampaignPrompt>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let p: CampaignPrompt = serde_json::from_str(line).map_err(|e| format!("line {}: {e}", i + 1))?;
        if p.domain.trim().is_empty() || p.messages.as_array().is_none_or(|m| m.is_empty()) {
            return Err(format!("line {}: a prompt needs a domain and a non-empty messages list", i + 1));
        }
        out.push(p);
    }
    if out.is_empty() {
        return Err("the prompt set is empty".into());
    }
    Ok(out)
}

/// How the campaign runs.
#[derive(Debug, Clone)]
pub struct CampaignOptions {
    /// Greedy tokens generated after each prompt (their routing counts too); 0: prompts only.
    pub generate: usize,
    /// The template's `enable_thinking` (`None`: the template's default).
    pub enable_thinking: Option<bool>,
    /// Prompt tokens per forward call.
    pub chunk: usize,
    /// Where the prompts come from, for the hotlist's `campaign` record.
    pub prompt_set_label: String,
    /// Tokens that end a generation early (end of turn).
    pub stop_tokens: Vec<u32>,
}

/// Runs the campaign over `prompts` and returns the hotlist. `progress` is called after each prompt with
/// (prompts done, tokens so far).
///
/// Errors: a prompt the template or tokenizer refuses (naming it), or a model error.
pub fn run_campaign(
    model: &Qwen4Exp,
    tokenizer: &TextTokenizer,
    template: &ChatTemplate,
    model_name: &str,
    prompts: &[CampaignPrompt],
    opts: &CampaignOptions,
    mut progress: impl FnMut(usize, u64),
) -> Result<Hotlist, String> {
    let cfg = &model.config;
    let mut builder = HotlistBuilder::new(cfg.n_layer, cfg.n_expert);
    let model_err = |i: usize, e: ModelError| format!("prompt {}: {e}", i + 1);
    for (i, p) in prompts.iter().enumerate() {
        let mut req = RenderRequest::new(&p.messages);
        req.add_generation_prompt = true;
        req.enable_thinking = opts.enable_thinking;
        let text = template.render(&req).map_err(|e| format!("prompt {} ({}): template: {e}", i + 1, p.domain))?;
        let ids = tokenizer.encode(&text).map_err(|e| format!("prompt {} ({}): tokenizer: {e}", i + 1, p.domain))?;
        let mut state = model.new_state(ids.len() + opts.generate + 1);
        let mut logits = Vec::new();
        let chunks: Vec<&[u32]> = ids.chunks(opts.chunk.max(1)).collect();
        for (k, c) in chunks.iter().enumerate() {
            let want = if k + 1 == chunks.len() { LogitsFor::Last } else { LogitsFor::None };
            logits = model.forward_recording(&mut state, c, want, &mut builder).map_err(|e| model_err(i, e))?;
        }
        for _ in 0..opts.generate {
            let next = argmax(&logits).unwrap_or(0) as u32;
            if opts.stop_tokens.contains(&next) {
                break;
            }
            logits = model
                .forward_recording(&mut state, &[next], LogitsFor::Last, &mut builder)
                .map_err(|e| model_err(i, e))?;
        }
        progress(i + 1, builder.tokens());
    }
    let domains: BTreeSet<&str> = prompts.iter().map(|p| p.domain.as_str()).collect();
    let campaign = serde_json::json!({
        "prompt_set": opts.prompt_set_label,
        "prompts": prompts.len(),
        "domains": domains.len(),
        "tokens": builder.tokens(),
        "generated_per_prompt": opts.generate,
        "enable_thinking": opts.enable_thinking,
        "tool": format!("nebula hotlist {}", env!("CARGO_PKG_VERSION")),
    });
    Ok(builder.finish(
        HotlistModel {
            name: model_name.to_owned(),
            n_layer: cfg.n_layer,
            n_expert: cfg.n_expert,
            n_expert_used: cfg.n_expert_used,
        },
        campaign,
    ))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::gguf::GgufFile;
    use crate::text::tokenizer::GgufVocab;

    #[test]
    fn the_committed_prompt_set_is_large_and_varied() {
        let p = parse_prompt_set(DEFAULT_PROMPT_SET).unwrap();
        let domains: BTreeSet<&str> = p.iter().map(|p| p.domain.as_str()).collect();
        assert!(p.len() >= 120 && domains.len() >= 12, "{} prompts in {} domains", p.len(), domains.len());
        assert!(parse_prompt_set("{\"domain\": \"x\", \"messages\": []}\n").unwrap_err().contains("line 1"));
        assert!(parse_prompt_set("\n\nnot json").unwrap_err().starts_with("line 3"));
    }

    #[test]
    fn a_campaign_counts_every_token_of_every_layer() {
        let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/nebula-demo.gguf");
        let file = Arc::new(GgufFile::open(&path).unwrap());
        let vocab = GgufVocab::from_gguf(&file).unwrap().unwrap();
        let tok = TextTokenizer::from_gguf_vocab(&vocab).unwrap();
        let template = ChatTemplate::new(file.get_str_opt("tokenizer.chat_template").unwrap().unwrap()).unwrap();
        let model = Qwen4Exp::from_gguf(file).unwrap();
        let prompts = parse_prompt_set(DEFAULT_PROMPT_SET).unwrap()[..3].to_vec();
        let opts = CampaignOptions {
            generate: 2,
            enable_thinking: Some(false),
            chunk: 16,
            prompt_set_label: "test".into(),
            stop_tokens: Vec::new(),
        };
        let mut calls = 0;
        let h = run_campaign(&model, &tok, &template, "demo", &prompts, &opts, |_, _| calls += 1).unwrap();
        assert_eq!(calls, 3);
        let tokens = h.campaign["tokens"].as_u64().unwrap();
        assert!(tokens > 3 * 10, "{tokens} tokens");
        for l in &h.layers {
            let uses: u64 = l.count.iter().sum();
            assert_eq!(uses, tokens * model.config.n_expert_used as u64, "layer {}", l.layer);
            let mass: f64 = l.weight.iter().sum();
            assert!((mass - tokens as f64).abs() < 1e-3 * tokens as f64, "layer {}: weights sum to {mass}", l.layer);
        }
        // The written file reads back.
        assert_eq!(Hotlist::parse(&h.to_json(), "t").unwrap(), h);
    }
}
