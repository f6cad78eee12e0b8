//! `POST /v1/chat/completions`, streamed (SSE) and not.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use tokio::sync::mpsc;

use crate::chat::prepare_blocking;
use crate::error::{ApiError, ErrorBody};
use crate::extract::OpenAiJson;
use crate::generation::{DriveSettings, Piece, start};
use crate::openai::{
    AssistantMessage, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, Choice, ChoiceLogprobs, FinishReason,
    FunctionCall, Timings, ToolCall, Usage,
};
use crate::state::{AppState, SHUTDOWN_MESSAGE, unix_now};
use crate::stream::{ChunkMeta, chat_sse};

/// Runs one chat completion. Errors before generation starts are HTTP errors; a failure after a stream began is
/// an error event in the stream.
#[utoipa::path(post, path = "/v1/chat/completions", tag = "openai", request_body = ChatCompletionRequest,
    responses(
        (status = 200, description = "The completion (`stream: false`), or server-sent events of \
            `ChatCompletionChunk`s ending with `data: [DONE]` (`stream: true`)",
            content((ChatCompletion = "application/json"), (ChatCompletionChunk = "text/event-stream"))),
        (status = 400, description = "Invalid request", body = ErrorBody),
        (status = 401, description = "Missing or wrong API key", body = ErrorBody),
        (status = 404, description = "Unknown model", body = ErrorBody),
        (status = 413, description = "Body too large", body = ErrorBody),
        (status = 429, description = "Queue full; see Retry-After", body = ErrorBody),
        (status = 500, description = "Generation failed", body = ErrorBody),
        (status = 503, description = "The model is loading", body = ErrorBody),
        (status = 504, description = "Timed out", body = ErrorBody),
    ))]
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    OpenAiJson(req): OpenAiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let model = state.model()?;
    let prepared = prepare_blocking(model.clone(), state.config.defaults.clone(), req).await?;
    let id = format!("chatcmpl-{:032x}", rand::random::<u128>());
    tracing::debug!(%id, prompt_tokens = prepared.prompt_tokens, thinking = prepared.thinking, stream = prepared.stream, n = prepared.n, "chat completion");
    let settings = DriveSettings {
        watchdog: Duration::from_secs_f64(state.config.watchdog_s),
        metrics: state.metrics.clone(),
        arrived,
        chat: true,
    };
    let n = prepared.n;
    let pieces = start(prepared.generation, n, settings)?;
    let created = unix_now();
    if prepared.stream {
        let meta = ChunkMeta {
            id,
            created,
            model: model.id.clone(),
            include_usage: prepared.include_usage,
            n,
            keepalive: Duration::from_secs_f64(state.config.sse_keepalive_s),
        };
        return Ok(chat_sse(meta, pieces).into_response());
    }
    let (choices, usage, timings) = collect(pieces, n).await?;
    Ok(Json(ChatCompletion {
        id,
        object: "chat.completion",
        created,
        model: model.id.clone(),
        choices,
        usage,
        timings,
    })
    .into_response())
}

/// Reads every choice to its end. If the client goes away, this future is dropped with `pieces`, which cancels
/// the generation.
async fn collect(
    mut pieces: mpsc::Receiver<(usize, Piece)>,
    n: usize,
) -> Result<(Vec<Choice>, Usage, Timings), ApiError> {
    #[derive(Default)]
    struct Parts {
        reasoning: String,
        content: String,
        tool_calls: Vec<ToolCall>,
        logprobs: Option<ChoiceLogprobs>,
        end: Option<(FinishReason, Usage, Timings)>,
    }
    let mut parts: Vec<Parts> = (0..n).map(|_| Parts::default()).collect();
    let mut done = 0;
    while done < n {
        let Some((i, piece)) = pieces.recv().await else {
            return Err(ApiError::Internal("the generation ended unexpectedly".into()));
        };
        let p = &mut parts[i];
        match piece {
            Piece::Reasoning(text) => p.reasoning.push_str(&text),
            Piece::Content(text) => p.content.push_str(&text),
            Piece::ToolCall { id, name, arguments, .. } => {
                p.tool_calls.push(ToolCall { id, kind: "function", function: FunctionCall { name, arguments } });
            }
            Piece::ToolCallStart { id, name, .. } => {
                p.tool_calls.push(ToolCall {
                    id,
                    kind: "function",
                    function: FunctionCall { name, arguments: String::new() },
                });
            }
            Piece::ToolCallArguments { fragment, .. } => {
                if let Some(call) = p.tool_calls.last_mut() {
                    call.function.arguments.push_str(&fragment);
                }
            }
            Piece::Logprob(lp) => p.logprobs.get_or_insert_with(ChoiceLogprobs::default).content.push(lp),
            Piece::Progress => {}
            Piece::Done { finish_reason, usage, timings } => {
                p.end = Some((finish_reason, usage, timings));
                done += 1;
            }
            Piece::Failed(message) if message == SHUTDOWN_MESSAGE => return Err(ApiError::ShuttingDown),
            Piece::Failed(message) => return Err(ApiError::Internal(format!("generation failed: {message}"))),
        }
    }
    let mut usage: Option<Usage> = None;
    let mut timings = Timings::default();
    let mut choices = Vec::with_capacity(n);
    for (index, p) in parts.into_iter().enumerate() {
        let (finish_reason, u, t) = p.end.unwrap_or((FinishReason::Stop, Usage::new(0, 0), Timings::default()));
        if index == 0 {
            timings = t;
        }
        usage = Some(match usage {
            None => u,
            Some(total) => Usage::new(total.prompt_tokens, total.completion_tokens + u.completion_tokens)
                .with_details(total.prompt_tokens_details),
        });
        let message = AssistantMessage {
            role: "assistant",
            content: (!p.content.is_empty() || p.tool_calls.is_empty()).then_some(p.content),
            reasoning_content: (!p.reasoning.is_empty()).then_some(p.reasoning),
            tool_calls: p.tool_calls,
        };
        choices.push(Choice { index, message, finish_reason, logprobs: p.logprobs });
    }
    Ok((choices, usage.unwrap_or(Usage::new(0, 0)), timings))
}
