//! `POST /v1/messages` and `POST /v1/messages/count_tokens` (the Anthropic Messages API, see
//! [`crate::anthropic`]), and [`anthropic_errors`], the layer that gives every error under `/v1/messages`
//! Anthropic's body and status codes.
//!
//! The stream, in order: `message_start` (the message with no content; `usage.input_tokens` is the whole prompt
//! until the final count), `ping`, then per content block `content_block_start`, its `content_block_delta`s
//! (`thinking_delta` then one `signature_delta` for thinking, `text_delta` for text, `input_json_delta` for a
//! tool call's input, whose `partial_json` pieces concatenate to the input object), `content_block_stop`; then
//! `message_delta` with `stop_reason`, `stop_sequence` and the usage, and `message_stop`. A failure after the
//! stream began is an `error` event and the end of the stream. A thinking block's `signature` is its text
//! sealed by this server ([`crate::seal`]), so a client that replays the block gives the model its thinking
//! back even with `display: "omitted"`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, StreamExt};
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use crate::anthropic::{
    AnthropicErrorBody, CountTokensRequest, CountTokensResponse, MessageObject, MessageStreamEvent, MessageUsage,
    MessagesPlan, MessagesRequest, error_body, error_kind, to_chat_request,
};
use crate::blocks::{Block, BlockEvent, BlockKind, BlockTracker, collect_blocks};
use crate::chat::{PreparedChat, prepare_blocking};
use crate::conversation::set_output_budget;
use crate::error::ApiError;
use crate::extract::OpenAiJson;
use crate::generation::{DriveSettings, Piece, start};
use crate::openai::{FinishReason, Usage};
use crate::seal::ReasoningSeal;
use crate::state::{AppState, ServedModel};

/// Largest error body the error layer reads back to reshape (an error body is a few hundred bytes).
const ERROR_BODY_LIMIT: usize = 64 << 10;

/// Checks a messages request and prepares its generation (rendering and encoding on the blocking pool, so a long
/// conversation does not hold up other requests).
async fn prepare_messages(
    state: &AppState,
    model: &Arc<ServedModel>,
    req: &MessagesRequest,
) -> Result<(PreparedChat, MessagesPlan), ApiError> {
    model.check_name(Some(&req.model))?;
    let (chat, plan) = to_chat_request(req, &state.seal)?;
    let mut prepared = prepare_blocking(model.clone(), state.config.defaults.clone(), chat).await?;
    prepared.generation.parse.call_id_prefix = format!("toolu_{:016x}_", rand::random::<u64>());
    Ok((prepared, plan))
}

/// Creates a message. Errors are Anthropic error bodies (see [`anthropic_errors`]); a failure after a stream
/// began is an `error` event.
#[utoipa::path(post, path = "/v1/messages", tag = "anthropic", request_body = MessagesRequest,
    params(("anthropic-version" = Option<String>, Header, description = "Accepted (any version)"),
        ("anthropic-beta" = Option<String>, Header, description = "Accepted; betas are ignored"),
        ("x-api-key" = Option<String>, Header, description = "The API key, as the Bearer key"),
        ("beta" = Option<bool>, Query, description = "Accepted (Claude Code sends `?beta=true`)")),
    responses(
        (status = 200, description = "The message (`stream: false`), or server-sent events of \
            `MessageStreamEvent`s (`stream: true`)",
            content((MessageObject = "application/json"), (MessageStreamEvent = "text/event-stream"))),
        (status = 400, description = "Invalid request", body = AnthropicErrorBody),
        (status = 401, description = "Missing or wrong API key", body = AnthropicErrorBody),
        (status = 404, description = "Unknown model", body = AnthropicErrorBody),
        (status = 413, description = "Body too large", body = AnthropicErrorBody),
        (status = 429, description = "Queue full; see Retry-After", body = AnthropicErrorBody),
        (status = 500, description = "Generation failed", body = AnthropicErrorBody),
        (status = 504, description = "Timed out", body = AnthropicErrorBody),
        (status = 529, description = "The model is loading", body = AnthropicErrorBody),
    ))]
pub async fn create_message(
    State(state): State<Arc<AppState>>,
    OpenAiJson(req): OpenAiJson<MessagesRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let model = state.model()?;
    let (mut prepared, plan) = prepare_messages(&state, &model, &req).await?;
    set_output_budget(&mut prepared, Some(req.max_tokens), "max_tokens", true)?;
    if !plan.stop_sequences.is_empty() {
        prepared.generation.stop = plan.stop_sequences.clone();
        // Each token's bytes (in its log-probability entry) tell which stop sequence matched.
        prepared.generation.request.logprobs.get_or_insert(0);
    }
    let prompt_tokens = prepared.prompt_tokens;
    let settings = DriveSettings {
        watchdog: Duration::from_secs_f64(state.config.watchdog_s),
        metrics: state.metrics.clone(),
        arrived,
        chat: true,
    };
    let pieces = start(prepared.generation, 1, settings)?;
    let ctx = Ctx {
        id: format!("msg_{:032x}", rand::random::<u128>()),
        model: req.model.clone(),
        plan,
        seal: state.seal.clone(),
        prompt_tokens,
    };
    if req.stream.unwrap_or(false) {
        return Ok(message_sse(ctx, pieces, Duration::from_secs_f64(state.config.sse_keepalive_s)).into_response());
    }
    let (blocks, finish, usage, stop_sequence) = collect_blocks(pieces, ctx.plan.stop_sequences.clone())
        .await
        .map_err(|m| ApiError::Internal(format!("generation failed: {m}")))?;
    let content = blocks.iter().map(|b| ctx.block(b, true)).collect();
    Ok(Json(ctx.message(content, Some((finish, usage, stop_sequence)))).into_response())
}

/// Counts the tokens of a messages request's prompt (rendered as `POST /v1/messages` renders it).
#[utoipa::path(post, path = "/v1/messages/count_tokens", tag = "anthropic", request_body = CountTokensRequest,
    responses(
        (status = 200, description = "The prompt's token count", body = CountTokensResponse),
        (status = 400, description = "Invalid request, or a prompt over the context", body = AnthropicErrorBody),
        (status = 401, description = "Missing or wrong API key", body = AnthropicErrorBody),
        (status = 404, description = "Unknown model", body = AnthropicErrorBody),
        (status = 529, description = "The model is loading", body = AnthropicErrorBody),
    ))]
pub async fn count_tokens(
    State(state): State<Arc<AppState>>,
    OpenAiJson(req): OpenAiJson<CountTokensRequest>,
) -> Result<Json<CountTokensResponse>, ApiError> {
    let model = state.model()?;
    let (prepared, _) = prepare_messages(&state, &model, &MessagesRequest::from(req)).await?;
    Ok(Json(CountTokensResponse { input_tokens: prepared.prompt_tokens }))
}

struct Ctx {
    id: String,
    model: String,
    plan: MessagesPlan,
    seal: ReasoningSeal,
    prompt_tokens: usize,
}

fn stop_reason(finish: FinishReason, stop_sequence: &Option<String>) -> &'static str {
    match finish {
        FinishReason::ToolCalls => "tool_use",
        FinishReason::Length => "max_tokens",
        FinishReason::Stop if stop_sequence.is_some() => "stop_sequence",
        FinishReason::Stop => "end_turn",
    }
}

impl Ctx {
    /// The content block of `block`; `done: false` gives the empty block of `content_block_start`.
    fn block(&self, block: &Block, done: bool) -> Value {
        match &block.kind {
            BlockKind::Reasoning => {
                let shown = if done && !self.plan.omit_thinking { block.text.as_str() } else { "" };
                let signature = if done { self.seal.seal(&block.text) } else { String::new() };
                json!({"type": "thinking", "thinking": shown, "signature": signature})
            }
            BlockKind::Text => json!({"type": "text", "text": if done { block.text.as_str() } else { "" }}),
            BlockKind::ToolCall { id, name } => {
                let input = if done { tool_input(&block.text) } else { json!({}) };
                json!({"type": "tool_use", "id": id, "name": name, "input": input})
            }
        }
    }

    fn message(&self, content: Vec<Value>, end: Option<(FinishReason, Usage, Option<String>)>) -> MessageObject {
        let (stop_reason, stop_sequence, usage) = match end {
            Some((finish, usage, stop)) => (Some(stop_reason(finish, &stop)), stop, MessageUsage::from_usage(&usage)),
            None => (None, None, MessageUsage::from_usage(&Usage::new(self.prompt_tokens, 0))),
        };
        MessageObject {
            id: self.id.clone(),
            kind: "message",
            role: "assistant",
            model: self.model.clone(),
            content,
            stop_reason,
            stop_sequence,
            usage,
        }
    }
}

/// A tool call's arguments text as the `input` object (the parser writes a JSON object; anything else is kept
/// under `_raw` rather than lost).
fn tool_input(arguments: &str) -> Value {
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            tracing::warn!(%arguments, "a tool call's arguments are not a JSON object");
            json!({"_raw": arguments})
        }
    }
}

struct StreamState {
    ctx: Ctx,
    pieces: mpsc::Receiver<(usize, Piece)>,
    tracker: BlockTracker,
    kinds: Vec<BlockKind>,
    started: bool,
    closed: bool,
}

fn sse_event(kind: &str, fields: Value) -> Event {
    let fields = match fields {
        Value::Object(map) => map,
        _ => Map::new(),
    };
    let event = MessageStreamEvent { kind: kind.to_owned(), fields };
    let data = serde_json::to_string(&event).unwrap_or_default();
    Event::default().event(kind).data(data)
}

fn error_event(message: &str) -> Event {
    let body = error_body("api_error", format!("generation failed: {message}"));
    Event::default().event("error").data(serde_json::to_string(&body).unwrap_or_default())
}

impl StreamState {
    fn events_for(&mut self, event: BlockEvent) -> Vec<Event> {
        let mut out = Vec::new();
        match event {
            BlockEvent::Start { index, kind } => {
                self.kinds.push(kind.clone());
                let block = self.ctx.block(&Block { kind, text: String::new() }, false);
                out.push(sse_event("content_block_start", json!({"index": index, "content_block": block})));
            }
            BlockEvent::Delta { index, text } => {
                let delta = match self.kinds.get(index) {
                    Some(BlockKind::Reasoning) if self.ctx.plan.omit_thinking => return out,
                    Some(BlockKind::Reasoning) => json!({"type": "thinking_delta", "thinking": text}),
                    Some(BlockKind::Text) => json!({"type": "text_delta", "text": text}),
                    Some(BlockKind::ToolCall { .. }) => json!({"type": "input_json_delta", "partial_json": text}),
                    None => return out,
                };
                out.push(sse_event("content_block_delta", json!({"index": index, "delta": delta})));
            }
            BlockEvent::Stop { index, block } => {
                if block.kind == BlockKind::Reasoning {
                    let signature = self.ctx.seal.seal(&block.text);
                    out.push(sse_event(
                        "content_block_delta",
                        json!({"index": index, "delta": {"type": "signature_delta", "signature": signature}}),
                    ));
                }
                out.push(sse_event("content_block_stop", json!({"index": index})));
            }
            BlockEvent::Done { finish_reason, usage, stop_sequence } => {
                let reason = stop_reason(finish_reason, &stop_sequence);
                out.push(sse_event(
                    "message_delta",
                    json!({"delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                        "usage": MessageUsage::from_usage(&usage)}),
                ));
                out.push(sse_event("message_stop", json!({})));
                self.closed = true;
            }
            BlockEvent::Failed(message) => {
                out.push(error_event(&message));
                self.closed = true;
            }
        }
        out
    }
}

fn message_sse(ctx: Ctx, pieces: mpsc::Receiver<(usize, Piece)>, keepalive: Duration) -> impl IntoResponse {
    let tracker = BlockTracker::new(ctx.plan.stop_sequences.clone());
    let state = StreamState { ctx, pieces, tracker, kinds: Vec::new(), started: false, closed: false };
    let events = stream::unfold(state, |mut st| async move {
        if st.closed {
            return None;
        }
        if !st.started {
            st.started = true;
            let message = serde_json::to_value(st.ctx.message(Vec::new(), None)).unwrap_or_default();
            let start = sse_event("message_start", json!({"message": message}));
            return Some((vec![start, sse_event("ping", json!({}))], st));
        }
        let events = match st.pieces.recv().await {
            Some((_, piece)) => {
                let mut events = Vec::new();
                for e in st.tracker.push(piece) {
                    events.extend(st.events_for(e));
                }
                events
            }
            None => {
                st.closed = true;
                vec![error_event("the generation ended unexpectedly")]
            }
        };
        Some((events, st))
    })
    .flat_map(stream::iter)
    .map(Ok::<_, Infallible>);
    Sse::new(events).keep_alive(KeepAlive::new().interval(keepalive).text("keep-alive"))
}

/// Gives errors under `/v1/messages` (from the handlers, the extractor, the API key, body size and concurrency
/// layers, unknown sub-paths) Anthropic's body `{"type": "error", "error": {"type", "message"}}` and status codes
/// (529 `overloaded_error` while the model loads). Other paths pass untouched.
pub async fn anthropic_errors(req: Request, next: Next) -> Response {
    if !req.uri().path().starts_with("/v1/messages") {
        return next.run(req).await;
    }
    let response = next.run(req).await;
    let status = response.status();
    if status.is_success() {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, ERROR_BODY_LIMIT).await.unwrap_or_default();
    let message = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v.pointer("/error/message").and_then(Value::as_str).map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
    let message = if status == StatusCode::UNAUTHORIZED {
        "Missing or invalid API key: send `x-api-key: <key>` (or `Authorization: Bearer <key>`).".to_owned()
    } else {
        message
    };
    let (status, kind) = error_kind(status);
    let body = serde_json::to_vec(&error_body(kind, message)).unwrap_or_default();
    parts.status = status;
    parts.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    parts.headers.remove(header::CONTENT_LENGTH);
    if status == StatusCode::UNAUTHORIZED {
        parts.headers.remove(header::WWW_AUTHENTICATE);
    }
    Response::from_parts(parts, Body::from(body))
}
