//! Rendering and encoding a conversation so that text from the client can never become a control token.
//!
//! The chat template escapes nothing: a literal `<|im_end|>` in a
//! user message would end the turn on the HF path, and a user could forge a system or assistant turn. Nebula
//! keeps the template's own markers as control tokens and encodes every client string as plain text:
//!
//! 1. Before rendering, every client string (contents, reasoning, tool-call names and arguments, the tools
//!    array, keys included) gets a marker character inserted right after the `<` of each added-token spelling it
//!    contains (`<|im_end|>` becomes `<M|im_end|>`). The marker is a private-use character that occurs nowhere in
//!    the request, and it is not whitespace, so the template's `trim` and tests see the same text.
//! 2. The template renders as usual; its own markers are intact, the client's are broken by the marker.
//! 3. The rendered text is cut at the added tokens it still contains (the template's), those become their ids,
//!    and the text between them, with the markers removed, is encoded with added-token matching off
//!    ([`TextTokenizer::encode_plain`]).
//!
//! A prompt without client-typed special tokens encodes exactly as [`TextTokenizer::encode`] would encode it.
//! With `defaults.allow_special_tokens_in_content` the rendered text is encoded as is (the HF behaviour).

use nebula_engine::text::tokenizer::{TextTokenizer, TokenType};
use serde_json::Value;

/// Spellings of the tokenizer's added tokens (CONTROL and USER_DEFINED), longest first.
pub fn added_tokens(tokenizer: &TextTokenizer) -> Vec<(String, u32)> {
    let mut out: Vec<(String, u32)> = (0..tokenizer.vocab_len() as u32)
        .filter(|&id| matches!(tokenizer.token_type(id), Some(TokenType::Control | TokenType::UserDefined)))
        .filter_map(|id| tokenizer.id_to_token(id).map(|t| (t, id)))
        .collect();
    out.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
    out
}

/// A private-use character that occurs in none of `values`.
pub fn pick_marker(values: &[&Value]) -> char {
    let mut text = String::new();
    for v in values {
        collect_strings(v, &mut text);
    }
    ('\u{E000}'..='\u{F8FF}').find(|c| !text.contains(*c)).unwrap_or('\u{F8FF}')
}

fn collect_strings(v: &Value, out: &mut String) {
    match v {
        Value::String(s) => out.push_str(s),
        Value::Array(a) => a.iter().for_each(|x| collect_strings(x, out)),
        Value::Object(m) => m.iter().for_each(|(k, x)| {
            out.push_str(k);
            collect_strings(x, out)
        }),
        _ => {}
    }
}

/// `v` with the marker inserted into every added-token spelling of every string and key.
pub fn defuse(v: &Value, specials: &[(String, u32)], marker: char) -> Value {
    match v {
        Value::String(s) => Value::String(defuse_str(s, specials, marker)),
        Value::Array(a) => Value::Array(a.iter().map(|x| defuse(x, specials, marker)).collect()),
        Value::Object(m) => Value::Object(
            m.iter().map(|(k, x)| (defuse_str(k, specials, marker), defuse(x, specials, marker))).collect(),
        ),
        other => other.clone(),
    }
}

fn defuse_str(s: &str, specials: &[(String, u32)], marker: char) -> String {
    if !s.contains('<') {
        return s.to_owned();
    }
    let mut out = String::with_capacity(s.len() + 8);
    let mut rest = s;
    while let Some(at) = rest.find('<') {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        out.push('<');
        if specials.iter().any(|(t, _)| tail.starts_with(t.as_str())) {
            out.push(marker);
        }
        rest = &tail[1..];
    }
    out.push_str(rest);
    out
}

/// Encodes rendered text: the added tokens it contains become their ids, the text between them (markers
/// removed) is encoded as plain text.
///
/// Errors: the tokenizer's message.
pub fn encode_rendered(
    tokenizer: &TextTokenizer,
    rendered: &str,
    specials: &[(String, u32)],
    marker: char,
) -> Result<Vec<u32>, String> {
    let mut ids = Vec::new();
    let mut text_start = 0;
    let mut i = 0;
    let bytes = rendered.as_bytes();
    let plain = |from: usize, to: usize, ids: &mut Vec<u32>| -> Result<(), String> {
        if from < to {
            let piece: String = rendered[from..to].chars().filter(|&c| c != marker).collect();
            ids.extend(tokenizer.encode_plain(&piece).map_err(|e| e.to_string())?);
        }
        Ok(())
    };
    while i < bytes.len() {
        if bytes[i] == b'<'
            && let Some((t, id)) = specials.iter().find(|(t, _)| rendered[i..].starts_with(t.as_str()))
        {
            plain(text_start, i, &mut ids)?;
            ids.push(*id);
            i += t.len();
            text_start = i;
            continue;
        }
        i += 1;
    }
    plain(text_start, rendered.len(), &mut ids)?;
    Ok(ids)
}
