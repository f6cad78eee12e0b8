//! Constrained decoding with llguidance: `response_format` (`json_object`, `json_schema`) and forced tool calls
//! (`tool_choice: "required"` or a named function) become a Lark grammar whose token mask the engine applies
//! before each draw ([`nebula_engine::sampling::TokenConstraint`]).
//!
//! The grammar governs only the answer: when the prompt leaves the model thinking, the constraint stays idle
//! until the model writes `</think>`, so reasoning is free and only what follows it must match. Leading
//! whitespace is allowed (the model writes `\n\n` after `</think>`). Once the grammar is complete only the
//! end-of-turn token (`<|im_end|>`) is allowed, so the turn ends.
//!
//! Tool calls use the Qwen3.8 XML format the output parser reads: `<tool_call>` and `</tool_call>` are the
//! model's special tokens, then `<function=NAME>`, one `<parameter=KEY>\nVALUE\n</parameter>` per argument in
//! the schema's order (required ones always, optional ones maybe), string values raw (at most `maxLength`
//! characters when the schema gives one), other values JSON typed by their schema (`%json`).

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use nebula_engine::sampling::TokenConstraint;
use nebula_engine::text::tokenizer::TextTokenizer;
use nebula_engine::worker::ConstraintHandle;
use serde_json::{Map, Value};

use crate::error::ApiError;

/// The tokenizer as llguidance sees it: every vocabulary row's bytes (special tokens as `0xFF` + name, the
/// toktrie convention, so text never matches them).
struct NebulaTokEnv {
    trie: TokTrie,
    tokenizer: Arc<TextTokenizer>,
}

impl TokenizerEnv for NebulaTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.tokenizer.encode_plain(&String::from_utf8_lossy(s)).unwrap_or_default()
    }
}

/// Compiles grammars for one model (built once, at first use: the token trie covers the whole vocabulary).
pub struct GrammarCompiler {
    factory: ParserFactory,
    think_end: Option<u32>,
    /// Tokens that end a turn (`<|im_end|>`, `<|endoftext|>`): forbidden while the model is still thinking, so a
    /// constrained answer (a forced tool call, a JSON reply) cannot be skipped by ending the turn inside the
    /// reasoning.
    turn_ends: Vec<u32>,
    vocab: usize,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").field("vocab", &self.vocab).finish_non_exhaustive()
    }
}

impl GrammarCompiler {
    /// A compiler for `tokenizer` over `vocab` logit rows, ending turns with `end_of_turn`.
    ///
    /// Errors: llguidance refuses the token set.
    pub fn new(tokenizer: Arc<TextTokenizer>, vocab: usize, end_of_turn: u32) -> Result<Self, String> {
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| match (tokenizer.token_bytes(id), tokenizer.token_type(id)) {
                (Some(bytes), Some(t)) if t != nebula_engine::text::tokenizer::TokenType::Normal => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(bytes);
                    w
                }
                (Some(bytes), _) => bytes.to_vec(),
                (None, _) => Vec::new(),
            })
            .collect();
        let info = TokRxInfo::new(vocab as u32, end_of_turn);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(NebulaTokEnv { trie, tokenizer: tokenizer.clone() });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        let turn_ends = ["<|im_end|>", "<|endoftext|>"].iter().filter_map(|t| tokenizer.token_to_id(t)).collect();
        Ok(Self { factory, think_end: tokenizer.token_to_id("</think>"), turn_ends, vocab })
    }

    /// A constraint for `lark` (a Lark grammar), idle until `</think>` when `starts_in_reasoning`.
    ///
    /// Errors: 400 naming `param` when the grammar does not compile (e.g. an unsupported schema keyword).
    pub fn constraint(&self, lark: &str, starts_in_reasoning: bool, param: &str) -> Result<ConstraintHandle, ApiError> {
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_lark(lark.to_owned()))
            .map_err(|e| ApiError::invalid(format!("The grammar for `{param}` cannot be compiled: {e}"), param))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ApiError::invalid(format!("The grammar for `{param}` cannot be compiled: {e}"), param));
        }
        Ok(ConstraintHandle::new(Box::new(GrammarConstraint {
            matcher,
            active: !starts_in_reasoning,
            think_end: self.think_end,
            turn_ends: if self.think_end.is_some() { self.turn_ends.clone() } else { Vec::new() },
            vocab: self.vocab,
        })))
    }
}

/// The per-request constraint.
struct GrammarConstraint {
    matcher: Matcher,
    active: bool,
    think_end: Option<u32>,
    turn_ends: Vec<u32>,
    vocab: usize,
}

impl TokenConstraint for GrammarConstraint {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        if !self.active {
            // Thinking is free, but the turn may not end before `</think>` opens the constrained answer.
            for &t in &self.turn_ends {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
            return Ok(());
        }
        let mask = self.matcher.compute_mask_or_eos().map_err(|e| e.to_string())?;
        for (id, logit) in logits.iter_mut().enumerate().take(self.vocab) {
            if !mask.is_allowed(id as u32) {
                *logit = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<(), String> {
        if !self.active {
            self.active = Some(token) == self.think_end;
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(|e| e.to_string())
    }
}

/// Whitespace allowed before the constrained answer (bounded: a model may otherwise prefer blank lines forever).
const LEADING_SPACE: &str = r#"/[ \n]{0,2}/"#;

/// llguidance's JSON layout options: compact, with Python's `json.dumps` separators. Bounded layout keeps a
/// model from filling the answer with whitespace, which flexible JSON whitespace would allow.
fn with_layout(mut schema: Value) -> Value {
    if let Value::Object(map) = &mut schema {
        map.entry("x-guidance").or_insert_with(
            || serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// A Lark grammar for `response_format`; `None` for `text`.
///
/// Errors: 400 naming `response_format` for an unknown type or a `json_schema` without a schema object.
pub fn response_format_grammar(format: &Value) -> Result<Option<String>, ApiError> {
    let param = "response_format";
    let kind = format.get("type").and_then(Value::as_str);
    let schema = match kind {
        Some("text") => return Ok(None),
        Some("json_object") => serde_json::json!({"type": "object"}),
        Some("json_schema") => {
            let spec = format.get("json_schema").and_then(Value::as_object).ok_or_else(|| {
                ApiError::invalid("`response_format.json_schema` must be an object with a `schema`.", param)
            })?;
            match spec.get("schema") {
                Some(Value::Object(schema)) => Value::Object(schema.clone()),
                Some(Value::Bool(true)) | None => serde_json::json!({}),
                Some(_) => {
                    return Err(ApiError::invalid("`response_format.json_schema.schema` must be an object.", param));
                }
            }
        }
        _ => {
            return Err(ApiError::invalid(
                "`response_format.type` must be \"text\", \"json_object\" or \"json_schema\".",
                param,
            ));
        }
    };
    let schema = with_layout(schema);
    Ok(Some(format!("start: {LEADING_SPACE} answer\nanswer: %json {schema}\n")))
}

/// A Lark grammar that forces tool calls: any of `tools` (or only `only`), one call or several.
///
/// Errors: 400 naming `tool_choice` when the named function is not among the tools.
pub fn tool_call_grammar(tools: &[Map<String, Value>], only: Option<&str>, parallel: bool) -> Result<String, ApiError> {
    let mut rules = String::new();
    let mut calls = Vec::new();
    for (t, tool) in tools.iter().enumerate() {
        let function = tool.get("function").and_then(Value::as_object);
        let Some(name) = function.and_then(|f| f.get("name")).and_then(Value::as_str) else { continue };
        if only.is_some_and(|o| o != name) {
            continue;
        }
        let params = function.and_then(|f| f.get("parameters"));
        let properties = params.and_then(|p| p.get("properties")).and_then(Value::as_object);
        let required: Vec<&str> = params
            .and_then(|p| p.get("required"))
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut body = Vec::new();
        for (p, (key, schema)) in properties.into_iter().flatten().enumerate() {
            let rule = format!("p{t}_{p}");
            let value = match bounded_string_token(schema) {
                Some(token) => {
                    let name = format!("S{t}_{p}");
                    rules.push_str(&format!("{name}: {token}\n"));
                    name
                }
                None => value_rule(schema),
            };
            rules.push_str(&format!(
                "{rule}: {} {value} {}\n",
                lark_str(&format!("<parameter={key}>\n")),
                lark_str("\n</parameter>\n")
            ));
            body.push(if required.contains(&key.as_str()) { rule } else { format!("{rule}?") });
        }
        rules.push_str(&format!(
            "call{t}: <tool_call> {} {} {} </tool_call>\n",
            lark_str(&format!("\n<function={name}>\n")),
            body.join(" "),
            lark_str("</function>\n")
        ));
        calls.push(format!("call{t}"));
    }
    if calls.is_empty() {
        return Err(match only {
            Some(name) => {
                ApiError::invalid(format!("`tool_choice` names `{name}`, which is not in `tools`."), "tool_choice")
            }
            None => ApiError::invalid("`tool_choice` requires a call but `tools` is empty.", "tool_choice"),
        });
    }
    let call = format!("call: {}\n", calls.join(" | "));
    let start = if parallel {
        format!("start: {LEADING_SPACE} call (\"\\n\" call)*\n")
    } else {
        format!("start: {LEADING_SPACE} call\n")
    };
    Ok(format!("{start}{call}{rules}"))
}

/// The grammar of one parameter value: raw text for strings (enums listed), JSON for other types.
fn value_rule(schema: &Value) -> String {
    let kind = schema.get("type").and_then(Value::as_str);
    if let Some(options) = schema.get("enum").and_then(Value::as_array) {
        let alts: Vec<String> = options
            .iter()
            .map(|v| match v {
                Value::String(s) => lark_str(s),
                other => lark_str(&other.to_string()),
            })
            .collect();
        if !alts.is_empty() {
            return format!("({})", alts.join(" | "));
        }
    }
    match kind {
        // Raw text that cannot close the parameter early: no `</` inside.
        Some("string") => r#"/([^<]|<[^\/])*/"#.to_owned(),
        _ => format!("%json {}", with_layout(schema.clone())),
    }
}

/// Raw string text that cannot close the parameter early: no `</` inside and no `<` at the end (the value is
/// followed by `\n</parameter>`).
const RAW_TEXT_EXCLUDED: &str = r#"~/(?s:.*<(\/.*)?)/"#;

/// For a `string` parameter with `maxLength` (or `minLength`) and no `enum`: a Lark token of raw text of that
/// many characters (JSON Schema counts code points, as the regex does), so a forced call cannot run past it.
/// `None` for other schemas.
fn bounded_string_token(schema: &Value) -> Option<String> {
    if schema.get("type").and_then(Value::as_str) != Some("string") || schema.get("enum").is_some() {
        return None;
    }
    let max = schema.get("maxLength").and_then(Value::as_u64);
    let min = schema.get("minLength").and_then(Value::as_u64);
    if max.is_none() && min.is_none() {
        return None;
    }
    let min = min.unwrap_or(0);
    let max = max.map_or(String::new(), |m| m.max(min).to_string());
    Some(format!("/(?s:.{{{min},{max}}})/ & {RAW_TEXT_EXCLUDED}"))
}

/// `s` as a Lark string literal (JSON escapes are Lark escapes).
fn lark_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grammars_name_the_parts() {
        let g = response_format_grammar(&serde_json::json!({"type": "json_object"})).unwrap().unwrap();
        assert!(g.contains("%json {\"type\":\"object\",\"x-guidance\""), "{g}");
        assert!(response_format_grammar(&serde_json::json!({"type": "text"})).unwrap().is_none());
        assert!(response_format_grammar(&serde_json::json!({"type": "xml"})).is_err());
        let tools: Vec<Map<String, Value>> = serde_json::from_value(serde_json::json!([{"type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
                "required": ["city"]}}}]))
        .unwrap();
        let g = tool_call_grammar(&tools, None, false).unwrap();
        assert!(g.contains("(\"Paris\" | \"Rome\")") && g.contains("p0_1?"), "{g}");
        assert!(tool_call_grammar(&tools, Some("g"), true).is_err());
    }

    /// A forced string parameter with `maxLength` takes at most that many characters: then only the closing tag
    /// may follow, so a call cannot run to the end of the context inside one value.
    #[cfg(not(feature = "lean"))]
    #[test]
    fn max_length_bounds_a_forced_string_value() {
        let engine = nebula_engine::worker::Engine::from_gguf_bytes(
            "demo",
            crate::config::EMBEDDED_DEMO_MODEL.to_vec(),
            Default::default(),
        )
        .unwrap();
        let tok = engine.tokenizer().clone();
        let vocab = engine.config().vocab;
        let compiler = GrammarCompiler::new(tok.clone(), vocab, tok.token_to_id("<|im_end|>").unwrap()).unwrap();
        let tools: Vec<Map<String, Value>> = serde_json::from_value(serde_json::json!([{"type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": {
                "q": {"type": "string", "maxLength": 3}}, "required": ["q"]}}}]))
        .unwrap();
        let grammar = tool_call_grammar(&tools, None, false).unwrap();
        let handle = compiler.constraint(&grammar, false, "tool_choice").unwrap();
        let mut c = handle.0.lock().unwrap();
        c.commit(tok.token_to_id("<tool_call>").unwrap()).unwrap();
        for id in tok.encode_plain("\n<function=f>\n<parameter=q>\n").unwrap() {
            c.commit(id).unwrap();
        }
        let x = tok.encode_plain("x").unwrap()[0];
        let allowed = |c: &mut Box<dyn TokenConstraint>| {
            let mut logits = vec![0f32; vocab];
            c.mask(&mut logits).unwrap();
            logits[x as usize].is_finite()
        };
        for _ in 0..3 {
            assert!(allowed(&mut c));
            c.commit(x).unwrap();
        }
        assert!(!allowed(&mut c), "a fourth character is over maxLength 3");
    }

    /// While the model thinks, only the turn's end is forbidden (so the constrained answer cannot be skipped);
    /// after `</think>` the grammar decides.
    #[cfg(not(feature = "lean"))]
    #[test]
    fn the_turn_cannot_end_inside_the_reasoning_of_a_constrained_answer() {
        let engine = nebula_engine::worker::Engine::from_gguf_bytes(
            "demo",
            crate::config::EMBEDDED_DEMO_MODEL.to_vec(),
            Default::default(),
        )
        .unwrap();
        let tok = engine.tokenizer().clone();
        let vocab = engine.config().vocab;
        let im_end = tok.token_to_id("<|im_end|>").unwrap();
        let eot = tok.token_to_id("<|endoftext|>").unwrap();
        let think_end = tok.token_to_id("</think>").unwrap();
        let compiler = GrammarCompiler::new(tok.clone(), vocab, im_end).unwrap();
        let grammar = response_format_grammar(&serde_json::json!({"type": "json_object"})).unwrap().unwrap();
        let handle = compiler.constraint(&grammar, true, "response_format").unwrap();
        let mut c = handle.0.lock().unwrap();
        let mut logits = vec![0f32; vocab];
        c.mask(&mut logits).unwrap();
        let banned: Vec<usize> = (0..vocab).filter(|&i| logits[i] == f32::NEG_INFINITY).collect();
        assert_eq!(banned, {
            let mut v = vec![im_end as usize, eot as usize];
            v.sort();
            v
        });
        c.commit(think_end).unwrap();
        let mut logits = vec![0f32; vocab];
        c.mask(&mut logits).unwrap();
        let allowed = logits.iter().filter(|v| v.is_finite()).count();
        assert!(allowed < vocab / 2, "after </think> the JSON grammar masks most tokens ({allowed} allowed)");
        assert_eq!(logits[im_end as usize], f32::NEG_INFINITY, "an empty answer is not a JSON object");
    }
}
