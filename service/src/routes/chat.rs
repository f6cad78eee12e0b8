//! `POST /v1/chat/completions`, streamed (SSE) and not.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};

use crate::chat::prepare;
use crate::error::ApiError;
use crate::extract::OpenAiJson;
use crate::generation::{Piece, start};
use crate::openai::{AssistantMessage, ChatCompletion, ChatCompletionRequest, Choice, FunctionCall, ToolCall};
use crate::state::{AppState, unix_now};
use crate::stream::{ChunkMeta, sse_response};

/// Runs one chat completion. Errors before generation starts are HTTP errors; a failure after a stream began is
/// an error event in the stream.
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    OpenAiJson(req): OpenAiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let model = state.model()?;
    let prepared = prepare(&model, req)?;
    let id = format!("chatcmpl-{:032x}", rand::random::<u128>());
    tracing::debug!(%id, prompt_tokens = prepared.prompt_tokens, thinking = prepared.thinking, stream = prepared.stream, "chat completion");
    let mut pieces = start(&model, prepared.generation)?;
    let created = unix_now();
    if prepared.stream {
        let meta = ChunkMeta { id, created, model: model.id.clone(), include_usage: prepared.include_usage };
        return Ok(sse_response(meta, pieces).into_response());
    }
    // Non-streamed: if the client goes away, this future is dropped with `pieces`, which cancels the generation.
    let mut reasoning = String::new();
    let mut content = String::new();
    let mut tool_calls = Vec::new();
    let (finish_reason, usage) = loop {
        match pieces.recv().await {
            Some(Piece::Reasoning(text)) => reasoning.push_str(&text),
            Some(Piece::Content(text)) => content.push_str(&text),
            Some(Piece::ToolCall { id, name, arguments, .. }) => {
                tool_calls.push(ToolCall { id, kind: "function", function: FunctionCall { name, arguments } });
            }
            Some(Piece::Done { finish_reason, usage }) => break (finish_reason, usage),
            Some(Piece::Failed(message)) => return Err(ApiError::Internal(format!("generation failed: {message}"))),
            None => return Err(ApiError::Internal("the generation ended unexpectedly".into())),
        }
    };
    let message = AssistantMessage {
        role: "assistant",
        content: (!content.is_empty() || tool_calls.is_empty()).then_some(content),
        reasoning_content: (!reasoning.is_empty()).then_some(reasoning),
        tool_calls,
    };
    Ok(Json(ChatCompletion {
        id,
        object: "chat.completion",
        created,
        model: model.id.clone(),
        choices: vec![Choice { index: 0, message, finish_reason, logprobs: None }],
        usage,
    })
    .into_response())
}
