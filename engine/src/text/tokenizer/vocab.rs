//! [`GgufVocab`]: the tokenizer as GGUF's `tokenizer.ggml.*` keys hold it, and its derivation from a HF
//! `tokenizer.json` (what our HF → GGUF converter writes), in llama.cpp's conventions.

use std::collections::HashMap;

use serde::Deserialize;

use super::{MAX_VOCAB_SIZE, QWEN35_PRETOKENIZER_REGEX, TokenizerError};

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum TokenType {
    Undefined = 0,
    /// An ordinary BPE token (ids 0…248043 for Qwen).
    Normal = 1,
    Unknown = 2,
    /// A control token: special in tokenizer.json or named `<|…|>` (`<|im_end|>`, `<|fim_prefix|>`, `<tts_pad>`).
    Control = 3,
    /// Another added token, matched atomically in text but kept by `skip_special` (`<think>`, `<tool_call>`).
    UserDefined = 4,
    /// A padding row that no token has (`[PAD248077]`…`[PAD248319]`).
    Unused = 5,
    Byte = 6,
}

impl TokenType {
    /// The type for a GGUF `token_type` value, if it is one of llama.cpp's seven.
    pub fn from_gguf(value: i32) -> Option<Self> {
        Some(match value {
            0 => Self::Undefined,
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => return None,
        })
    }

    /// The GGUF `token_type` value.
    pub fn as_gguf(self) -> i32 {
        self as i32
    }
}

/// The model name GGUF gives byte-level BPE tokenizers (`tokenizer.ggml.model`).
pub const GGUF_MODEL_GPT2: &str = "gpt2";
/// llama.cpp's pre-tokenizer name for the Qwen3.5 regex (`tokenizer.ggml.pre`, `LLAMA_VOCAB_PRE_TYPE_QWEN35`).
pub const GGUF_PRE_QWEN35: &str = "qwen35";

/// The tokenizer as stored in GGUF metadata, llama.cpp conventions (`llama-vocab.cpp`).
///
/// `tokens[i]` is token `i` spelled in GPT-2 byte-level characters (added tokens as their text), `token_types[i]` its
/// [`TokenType`] value, `merges` the BPE merges as `"a b"` strings in priority order. Ids without a token are rows
/// `[PAD{i}]` of type UNUSED that pad the vocabulary to the model's embedding size (248,320 for Qwen3.8).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: `"gpt2"`.
    pub model: String,
    /// `tokenizer.ggml.pre`: `"qwen35"`.
    pub pre: String,
    /// `tokenizer.ggml.tokens`.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`.
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.merges`.
    pub merges: Vec<String>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos_token_id: Option<u32>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos_token_id: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub padding_token_id: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`.
    pub add_bos_token: bool,
}

#[derive(Deserialize)]
struct TokenizerJson {
    #[serde(default)]
    added_tokens: Vec<AddedTokenJson>,
    normalizer: Option<serde_json::Value>,
    pre_tokenizer: Option<serde_json::Value>,
    decoder: Option<serde_json::Value>,
    model: ModelJson,
}

#[derive(Deserialize)]
struct AddedTokenJson {
    id: u32,
    content: String,
    #[serde(default)]
    special: bool,
}

#[derive(Deserialize)]
struct ModelJson {
    #[serde(rename = "type")]
    kind: Option<String>,
    vocab: HashMap<String, u32>,
    #[serde(default)]
    merges: Vec<MergeJson>,
    #[serde(default)]
    byte_fallback: bool,
    #[serde(default)]
    continuing_subword_prefix: Option<String>,
    #[serde(default)]
    end_of_word_suffix: Option<String>,
}

/// tokenizer.json writes merges either as `"a b"` (legacy) or as `["a", "b"]`.
#[derive(Deserialize)]
#[serde(untagged)]
enum MergeJson {
    Joined(String),
    Pair(String, String),
}

/// Whether an added token's name marks it as a control token even when tokenizer.json does not flag it special:
/// the rule llama.cpp's HF converter applies (`<|…|>` names such as `<|fim_prefix|>`, their full-width-bar
/// variant `<｜…｜>`, `<unused…>` names, and a few known pad/mask names).
pub fn looks_like_control_token(content: &str) -> bool {
    // Plain prefix and suffix tests, as the converter does: `<|>` counts too.
    let wrapped = |open: &str, close: &str| content.starts_with(open) && content.ends_with(close);
    wrapped("<|", "|>")
        || wrapped("<｜", "｜>")
        || wrapped("<unused", ">")
        || matches!(content, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
}

/// The GGUF type of an added token: CONTROL when tokenizer.json marks it special or its name looks special,
/// USER_DEFINED otherwise (as llama.cpp's `convert_hf_to_gguf.py` types them).
pub fn added_token_type(content: &str, special: bool) -> TokenType {
    if special || looks_like_control_token(content) { TokenType::Control } else { TokenType::UserDefined }
}

fn describe(value: &Option<serde_json::Value>) -> String {
    let s = value.as_ref().map_or_else(|| "null".to_string(), |v| v.to_string());
    if s.chars().count() > 200 { s.chars().take(200).collect::<String>() + "…" } else { s }
}

fn unsupported(field: &'static str, found: String) -> TokenizerError {
    TokenizerError::UnsupportedTokenizerJson { field, found }
}

/// The GGUF `pre` name of a tokenizer.json pre-tokenizer, if it is one we support: `Sequence[Split(Qwen3.5 regex,
/// Isolated), ByteLevel(add_prefix_space=false, use_regex=false)]` is `qwen35`.
fn gguf_pre_of(pre_tokenizer: &Option<serde_json::Value>) -> Option<&'static str> {
    let v = pre_tokenizer.as_ref()?;
    let steps = v.get("pretokenizers")?.as_array()?;
    let [split, byte_level] = steps.as_slice() else {
        return None;
    };
    let ok = v.get("type")?.as_str()? == "Sequence"
        && split.get("type")?.as_str()? == "Split"
        && split.get("pattern")?.get("Regex")?.as_str()? == QWEN35_PRETOKENIZER_REGEX
        && split.get("behavior")?.as_str()? == "Isolated"
        && !split.get("invert").and_then(|i| i.as_bool()).unwrap_or(false)
        && byte_level.get("type")?.as_str()? == "ByteLevel"
        && !byte_level.get("add_prefix_space")?.as_bool()?
        && !byte_level.get("use_regex").and_then(|u| u.as_bool()).unwrap_or(true);
    ok.then_some(GGUF_PRE_QWEN35)
}

impl GgufVocab {
    /// The GGUF vocabulary of a HF `tokenizer.json`, padded to `vocab_size` ids (the model's embedding rows,
    /// 248,320 for Qwen3.8), as llama.cpp's `convert_hf_to_gguf.py` lays it out:
    ///
    /// * id `i` of `model.vocab` → its byte-level spelling, NORMAL;
    /// * an added token → its text, CONTROL if `special` or named like `<|…|>` ([`looks_like_control_token`]),
    ///   USER_DEFINED otherwise (`<think>`, `<tool_call>`…);
    /// * an id with no token → `[PAD{i}]`, UNUSED.
    ///
    /// `merges` are written `"a b"`; `pre` is derived from the pre-tokenizer (only the Qwen3.5 pipeline, `qwen35`,
    /// is supported). eos/bos/pad are left unset and `add_bos_token` false: they live in tokenizer_config.json, see
    /// [`GgufVocab::apply_tokenizer_config`].
    ///
    /// Errors: malformed JSON, a normalizer other than NFC, another pre-tokenizer or decoder, a model other than
    /// byte-level BPE, a token id ≥ `vocab_size`, two tokens on one id, a merge with a space inside a part.
    pub fn from_tokenizer_json(bytes: &[u8], vocab_size: usize) -> Result<GgufVocab, TokenizerError> {
        let json: TokenizerJson =
            serde_json::from_slice(bytes).map_err(|e| TokenizerError::InvalidTokenizerJson(e.to_string()))?;

        if json.normalizer.as_ref().and_then(|n| n.get("type")).and_then(|t| t.as_str()) != Some("NFC") {
            return Err(unsupported("normalizer", describe(&json.normalizer)));
        }
        let pre = gguf_pre_of(&json.pre_tokenizer)
            .ok_or_else(|| unsupported("pre_tokenizer", describe(&json.pre_tokenizer)))?;
        if json.decoder.as_ref().and_then(|d| d.get("type")).and_then(|t| t.as_str()) != Some("ByteLevel") {
            return Err(unsupported("decoder", describe(&json.decoder)));
        }
        let m = &json.model;
        if m.kind.as_deref().is_some_and(|k| k != "BPE") {
            return Err(unsupported("model.type", format!("{:?}", m.kind)));
        }
        if m.byte_fallback {
            return Err(unsupported("model.byte_fallback", "true".into()));
        }
        for (field, value) in [
            ("model.continuing_subword_prefix", &m.continuing_subword_prefix),
            ("model.end_of_word_suffix", &m.end_of_word_suffix),
        ] {
            if value.as_deref().is_some_and(|v| !v.is_empty()) {
                return Err(unsupported(field, format!("{value:?}")));
            }
        }

        if vocab_size > MAX_VOCAB_SIZE {
            return Err(TokenizerError::TooManyTokens(vocab_size));
        }
        let mut slots: Vec<Option<(String, TokenType)>> = vec![None; vocab_size];
        let mut place = |id: u32, token: &str, ty: TokenType, replace: bool| -> Result<(), TokenizerError> {
            let slot = slots.get_mut(id as usize).ok_or_else(|| TokenizerError::TokenIdBeyondVocabSize {
                id,
                token: token.to_string(),
                vocab_size,
            })?;
            if let Some((first, _)) = slot.as_ref().filter(|_| !replace) {
                return Err(TokenizerError::DuplicateTokenId { id, first: first.clone(), second: token.to_string() });
            }
            *slot = Some((token.to_string(), ty));
            Ok(())
        };
        for (token, &id) in &m.vocab {
            place(id, token, TokenType::Normal, false)?;
        }
        // An added token may also be listed in model.vocab with the same id: the added entry decides its type.
        for added in &json.added_tokens {
            let also_in_vocab = m.vocab.get(&added.content) == Some(&added.id);
            place(added.id, &added.content, added_token_type(&added.content, added.special), also_in_vocab)?;
        }

        let mut tokens = Vec::with_capacity(vocab_size);
        let mut token_types = Vec::with_capacity(vocab_size);
        for (id, slot) in slots.into_iter().enumerate() {
            let (token, ty) = slot.unwrap_or_else(|| (format!("[PAD{id}]"), TokenType::Unused));
            tokens.push(token);
            token_types.push(ty.as_gguf());
        }

        let mut merges = Vec::with_capacity(m.merges.len());
        for (index, merge) in m.merges.iter().enumerate() {
            let (a, b) = match merge {
                MergeJson::Joined(s) => s.split_once(' ').ok_or_else(|| TokenizerError::InvalidMerge {
                    index,
                    merge: s.clone(),
                    reason: "no space between the two parts",
                })?,
                MergeJson::Pair(a, b) => (a.as_str(), b.as_str()),
            };
            if a.is_empty() || b.is_empty() || a.contains(' ') || b.contains(' ') {
                return Err(TokenizerError::InvalidMerge {
                    index,
                    merge: format!("{a} {b}"),
                    reason: "a part is empty or contains a space (GGUF merges are \"a b\")",
                });
            }
            merges.push(format!("{a} {b}"));
        }

        Ok(GgufVocab {
            model: GGUF_MODEL_GPT2.to_string(),
            pre: pre.to_string(),
            tokens,
            token_types,
            merges,
            eos_token_id: None,
            bos_token_id: None,
            padding_token_id: None,
            add_bos_token: false,
        })
    }

    /// Sets eos/bos/pad ids and `add_bos_token` from a HF `tokenizer_config.json` (`eos_token`, `bos_token`,
    /// `pad_token` as a string or `{"content": …}`, null for none; `add_bos_token`, default false). For
    /// Qwen3.8: eos `<|im_end|>` 248046, pad `<|endoftext|>` 248044, no bos (the released `tokenizer_config.json`).
    ///
    /// Errors: malformed JSON, or a named token that is not in `tokens`.
    pub fn apply_tokenizer_config(&mut self, config_json: &[u8]) -> Result<(), TokenizerError> {
        let config: serde_json::Value =
            serde_json::from_slice(config_json).map_err(|e| TokenizerError::InvalidTokenizerJson(e.to_string()))?;
        let lookup = |key: &'static str| -> Result<Option<u32>, TokenizerError> {
            let name = match config.get(key) {
                None | Some(serde_json::Value::Null) => return Ok(None),
                Some(serde_json::Value::String(s)) => s.as_str(),
                Some(v) => match v.get("content").and_then(|c| c.as_str()) {
                    Some(s) => s,
                    None => return Err(unsupported(key, v.to_string())),
                },
            };
            let id = self
                .tokens
                .iter()
                .zip(&self.token_types)
                .position(|(t, &ty)| t == name && ty != TokenType::Unused.as_gguf())
                .ok_or_else(|| TokenizerError::UnknownSpecialToken { key, token: name.to_string() })?;
            Ok(Some(id as u32))
        };
        let (eos, bos, pad) = (lookup("eos_token")?, lookup("bos_token")?, lookup("pad_token")?);
        self.eos_token_id = eos;
        self.bos_token_id = bos;
        self.padding_token_id = pad;
        self.add_bos_token = config.get("add_bos_token").and_then(|v| v.as_bool()).unwrap_or(false);
        Ok(())
    }

    /// The [`TokenType`] of id `id`, if `id` is in range and its `token_types` value is valid.
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.token_types.get(id as usize).copied().and_then(TokenType::from_gguf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_token_rule() {
        for (content, special, want) in [
            ("<|im_end|>", true, TokenType::Control),
            ("<|fim_prefix|>", false, TokenType::Control),
            ("<tts_pad>", true, TokenType::Control),
            ("<think>", false, TokenType::UserDefined),
            ("<tool_call>", false, TokenType::UserDefined),
            ("</tool_response>", false, TokenType::UserDefined),
            ("<|", false, TokenType::UserDefined),
            ("<|>", false, TokenType::Control),
            ("<||>", false, TokenType::Control),
            ("<｜begin▁of▁sentence｜>", false, TokenType::Control),
        ] {
            assert_eq!(added_token_type(content, special), want, "{content:?} special={special}");
        }
    }

    #[test]
    fn token_type_values_round_trip() {
        for v in 0..=6 {
            assert_eq!(TokenType::from_gguf(v).map(TokenType::as_gguf), Some(v));
        }
        assert_eq!(TokenType::from_gguf(7), None);
        assert_eq!(TokenType::from_gguf(-1), None);
    }
}

impl GgufVocab {
    /// Reads the `tokenizer.ggml.*` keys of a GGUF file (llama.cpp's layout). `Ok(None)` when
    /// the file carries no tokenizer (`tokenizer.ggml.tokens` absent).
    ///
    /// Errors: a present key of the wrong type, as [`TokenizerError::Gguf`] naming the key.
    pub fn from_gguf(file: &crate::gguf::GgufFile) -> Result<Option<Self>, TokenizerError> {
        let g = |e: crate::gguf::GgufError| TokenizerError::Gguf(e.to_string());
        let Some(tokens) = file.get_string_array_opt("tokenizer.ggml.tokens").map_err(g)? else {
            return Ok(None);
        };
        let n = tokens.len();
        let tokens: Vec<String> = tokens.into_iter().map(str::to_string).collect();
        let token_types = match file.get_i32_array_opt("tokenizer.ggml.token_type").map_err(g)? {
            Some(t) => t,
            None => vec![TokenType::Normal.as_gguf(); n],
        };
        let merges = file
            .get_string_array_opt("tokenizer.ggml.merges")
            .map_err(g)?
            .unwrap_or_default()
            .into_iter()
            .map(str::to_string)
            .collect();
        Ok(Some(Self {
            model: file.get_str_opt("tokenizer.ggml.model").map_err(g)?.unwrap_or("gpt2").to_string(),
            pre: file.get_str_opt("tokenizer.ggml.pre").map_err(g)?.unwrap_or("default").to_string(),
            tokens,
            token_types,
            merges,
            eos_token_id: file.get_u32_opt("tokenizer.ggml.eos_token_id").map_err(g)?,
            bos_token_id: file.get_u32_opt("tokenizer.ggml.bos_token_id").map_err(g)?,
            padding_token_id: file.get_u32_opt("tokenizer.ggml.padding_token_id").map_err(g)?,
            add_bos_token: file.get_bool_opt("tokenizer.ggml.add_bos_token").map_err(g)?.unwrap_or(false),
        }))
    }
}
