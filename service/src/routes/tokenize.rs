//! `POST /tokenize` and `POST /detokenize`, in the shapes of llama.cpp's server and vLLM's.
//!
//! Tokenize takes one of `content` (llama.cpp), `prompt` (vLLM) or `messages` (vLLM's chat form: rendered with
//! the chat template and encoded exactly as a chat completion's prompt is, generation prompt included). Text is
//! encoded with the template's special tokens recognised (`parse_special`, default true; false: as plain text).
//! `add_special` / `add_special_tokens` are accepted: this model's tokenizer adds no BOS or EOS either way.
//! `with_pieces` (llama.cpp) returns `[{"id", "piece"}]` (a piece that is not valid UTF-8 on its own is its byte
//! list); `return_token_strs` (vLLM) adds `token_strs`. The answer always has `tokens`, `count` and
//! `max_model_len`.
//!
//! Detokenize takes `tokens` and answers `content` (llama.cpp) and `prompt` (vLLM), the same text; an id
//! outside the vocabulary is a 400.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use utoipa::ToSchema;

use crate::chat::prepare;
use crate::error::{ApiError, ErrorBody};
use crate::extract::OpenAiJson;
use crate::openai::{ChatCompletionRequest, ChatMessage};
use crate::state::AppState;

/// Body of `POST /tokenize`: exactly one of `content`, `prompt` or `messages`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"content": "Hello world", "with_pieces": true}))]
pub struct TokenizeRequest {
    /// Text to encode (llama.cpp).
    pub content: Option<String>,
    /// Text to encode (vLLM).
    pub prompt: Option<String>,
    /// A conversation, rendered with the chat template first (vLLM).
    pub messages: Option<Vec<ChatMessage>>,
    /// Tools for the template (with `messages`).
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Vec<Map<String, Value>>>,
    /// Template variables (with `messages`), as in chat completions.
    #[schema(value_type = Option<Object>)]
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// With `messages`: must be true (the default); the prompt always ends with the assistant's turn opening.
    pub add_generation_prompt: Option<bool>,
    /// Model id (vLLM; must be one this server answers to).
    pub model: Option<String>,
    /// llama.cpp: add BOS/EOS (this tokenizer adds none).
    pub add_special: Option<bool>,
    /// vLLM's name of `add_special`.
    pub add_special_tokens: Option<bool>,
    /// Recognise special tokens written in the text (default true).
    pub parse_special: Option<bool>,
    /// llama.cpp: return `[{"id", "piece"}]` instead of ids.
    pub with_pieces: Option<bool>,
    /// vLLM: also return `token_strs`.
    pub return_token_strs: Option<bool>,
}

/// Answer of `POST /tokenize`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TokenizeResponse {
    /// Token ids, or `{"id", "piece"}` objects with `with_pieces`.
    #[schema(value_type = Vec<Value>)]
    pub tokens: Vec<Value>,
    /// How many tokens.
    pub count: usize,
    /// The server's context limit, tokens.
    pub max_model_len: usize,
    /// Each token's vocabulary spelling (`return_token_strs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_strs: Option<Vec<String>>,
}

/// Body of `POST /detokenize`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"tokens": [9707, 1879]}))]
pub struct DetokenizeRequest {
    /// Token ids.
    pub tokens: Vec<u32>,
    /// Model id (vLLM).
    pub model: Option<String>,
}

/// Answer of `POST /detokenize`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct DetokenizeResponse {
    /// The text (llama.cpp's name).
    pub content: String,
    /// The same text (vLLM's name).
    pub prompt: String,
}

/// Encodes text or a rendered conversation.
#[utoipa::path(post, path = "/tokenize", tag = "tokens", request_body = TokenizeRequest,
    responses((status = 200, description = "The tokens", body = TokenizeResponse),
              (status = 400, description = "Invalid request", body = ErrorBody),
              (status = 401, description = "Missing or wrong API key", body = ErrorBody),
              (status = 404, description = "Unknown model", body = ErrorBody),
              (status = 503, description = "The model is loading", body = ErrorBody)))]
pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    OpenAiJson(req): OpenAiJson<TokenizeRequest>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let model = state.model()?;
    model.check_name(req.model.as_deref())?;
    let tokenizer = model.engine.tokenizer();
    let given = [req.content.is_some(), req.prompt.is_some(), req.messages.is_some()].iter().filter(|x| **x).count();
    if given != 1 {
        return Err(ApiError::invalid("Give exactly one of `content`, `prompt` or `messages`.", "content"));
    }
    let ids = match (&req.content, &req.prompt, req.messages.clone()) {
        (Some(text), _, _) | (_, Some(text), _) => {
            let encoded =
                if req.parse_special.unwrap_or(true) { tokenizer.encode(text) } else { tokenizer.encode_plain(text) };
            encoded.map_err(|e| ApiError::invalid(format!("The text cannot be encoded: {e}"), "content"))?
        }
        (_, _, Some(messages)) => {
            if req.add_generation_prompt == Some(false) {
                return Err(ApiError::invalid(
                    "`add_generation_prompt: false` is not supported: the prompt is rendered as for a completion.",
                    "add_generation_prompt",
                ));
            }
            let chat = ChatCompletionRequest {
                messages,
                tools: req.tools.clone(),
                chat_template_kwargs: req.chat_template_kwargs.clone(),
                ..ChatCompletionRequest::default()
            };
            prepare(&model, &state.config.defaults, chat)?.generation.request.prompt
        }
        _ => Vec::new(),
    };
    let tokens = if req.with_pieces.unwrap_or(false) {
        ids.iter()
            .map(|&id| {
                let bytes = tokenizer.token_bytes(id).unwrap_or_default();
                let piece = match std::str::from_utf8(bytes) {
                    Ok(s) => json!(s),
                    Err(_) => json!(bytes),
                };
                json!({"id": id, "piece": piece})
            })
            .collect()
    } else {
        ids.iter().map(|&id| json!(id)).collect()
    };
    let token_strs = req
        .return_token_strs
        .unwrap_or(false)
        .then(|| ids.iter().map(|&id| tokenizer.id_to_token(id).unwrap_or_default()).collect());
    Ok(Json(TokenizeResponse { tokens, count: ids.len(), max_model_len: model.engine.max_context(), token_strs }))
}

/// Decodes token ids to text (special tokens included).
#[utoipa::path(post, path = "/detokenize", tag = "tokens", request_body = DetokenizeRequest,
    responses((status = 200, description = "The text", body = DetokenizeResponse),
              (status = 400, description = "Invalid request or an id outside the vocabulary", body = ErrorBody),
              (status = 401, description = "Missing or wrong API key", body = ErrorBody),
              (status = 404, description = "Unknown model", body = ErrorBody),
              (status = 503, description = "The model is loading", body = ErrorBody)))]
pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    OpenAiJson(req): OpenAiJson<DetokenizeRequest>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    let model = state.model()?;
    model.check_name(req.model.as_deref())?;
    // Ids inside the model's vocabulary without a token (its padding rows) decode to "", as in HF; ids past it
    // are refused.
    let vocab = model.engine.config().vocab;
    if let Some(&bad) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid(format!("Token id {bad} is outside the vocabulary of {vocab} ids."), "tokens"));
    }
    let text = model
        .engine
        .tokenizer()
        .decode(&req.tokens, false)
        .map_err(|e| ApiError::invalid(format!("The tokens cannot be decoded: {e}"), "tokens"))?;
    Ok(Json(DetokenizeResponse { content: text.clone(), prompt: text }))
}
