//! `POST /v1/responses` (the OpenAI Responses API, stateless; see [`crate::responses`]), streamed (SSE) and not.
//!
//! The stream, in order: `response.created`, `response.in_progress`; per output item (reasoning, message, function
//! call, in the order the model wrote them) `response.output_item.added`, its part's `added` event, its deltas,
//! its `done` events and `response.output_item.done`; then `response.completed` (or `response.incomplete` when
//! `max_output_tokens` or the context ended it), each event with its `type` as the SSE event name and a
//! `sequence_number` counting from 0. A failure after the stream began is a `response.failed` event carrying the
//! response with `status: "failed"` and its `error`; the stream ends there. While the engine prefills a long
//! prompt, SSE comments (`: keep-alive`) flow every `sse_keepalive_s`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, StreamExt};
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use crate::blocks::{Block, BlockEvent, BlockKind, BlockTracker, collect_blocks};
use crate::chat::prepare_blocking;
use crate::conversation::set_output_budget;
use crate::error::{ApiError, ErrorBody};
use crate::extract::OpenAiJson;
use crate::generation::{DriveSettings, Piece, start};
use crate::openai::{FinishReason, Usage};
use crate::responses::{
    CreateResponseRequest, InputTokensDetails, OutputTokensDetails, ResponseObject, ResponseStreamEvent, ResponseUsage,
    ResponsesPlan, to_chat_request,
};
use crate::state::{AppState, ServedModel, unix_now};

/// Creates a model response. Errors before generation starts are HTTP errors in the OpenAI body; a failure
/// after a stream began is a `response.failed` event.
#[utoipa::path(post, path = "/v1/responses", tag = "openai", request_body = CreateResponseRequest,
    responses(
        (status = 200, description = "The response (`stream: false`), or server-sent events of \
            `ResponseStreamEvent`s (`stream: true`)",
            content((ResponseObject = "application/json"), (ResponseStreamEvent = "text/event-stream"))),
        (status = 400, description = "Invalid or unsupported request", body = ErrorBody),
        (status = 401, description = "Missing or wrong API key", body = ErrorBody),
        (status = 404, description = "Unknown model", body = ErrorBody),
        (status = 413, description = "Body too large", body = ErrorBody),
        (status = 429, description = "Queue full; see Retry-After", body = ErrorBody),
        (status = 500, description = "Generation failed", body = ErrorBody),
        (status = 503, description = "The model is loading", body = ErrorBody),
        (status = 504, description = "Timed out", body = ErrorBody),
    ))]
pub async fn create_response(
    State(state): State<Arc<AppState>>,
    OpenAiJson(req): OpenAiJson<CreateResponseRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let model = state.model()?;
    model.check_name(req.model.as_deref())?;
    let (chat, plan) = to_chat_request(&req, &state.seal)?;
    let mut prepared = prepare_blocking(model.clone(), state.config.defaults.clone(), chat).await?;
    set_output_budget(&mut prepared, req.max_output_tokens, "max_output_tokens", false)?;
    let id = format!("resp_{:032x}", rand::random::<u128>());
    tracing::debug!(%id, prompt_tokens = prepared.prompt_tokens, thinking = prepared.thinking, "response");
    let settings = DriveSettings {
        watchdog: Duration::from_secs_f64(state.config.watchdog_s),
        metrics: state.metrics.clone(),
        arrived,
        chat: true,
    };
    let pieces = start(prepared.generation, 1, settings)?;
    let ctx = Ctx { plan, base: base_object(&req, id, &model), model, seal: state.seal.clone() };
    if req.stream.unwrap_or(false) {
        return Ok(response_sse(ctx, pieces, Duration::from_secs_f64(state.config.sse_keepalive_s)).into_response());
    }
    let (blocks, finish, usage, _) =
        collect_blocks(pieces, Vec::new()).await.map_err(|m| ApiError::Internal(format!("generation failed: {m}")))?;
    let mut ids = ItemIds::default();
    let output: Vec<Value> =
        blocks.iter().enumerate().map(|(i, b)| ctx.item(b, ids.get(i, &b.kind), "completed")).collect();
    Ok(Json(ctx.finished(output, &blocks, finish, usage)).into_response())
}

/// The response object before any output: the request's settings echoed.
fn base_object(req: &CreateResponseRequest, id: String, model: &ServedModel) -> ResponseObject {
    let reasoning = req.reasoning.as_ref().map_or(
        json!({"effort": null, "summary": null}),
        |r| json!({"effort": r.effort, "summary": r.summary.clone().or(r.generate_summary.clone())}),
    );
    let format = req.text.as_ref().and_then(|t| t.format.clone()).unwrap_or(json!({"type": "text"}));
    ResponseObject {
        id,
        object: "response",
        created_at: unix_now(),
        status: "in_progress",
        error: None,
        incomplete_details: None,
        instructions: req.instructions.clone(),
        max_output_tokens: req.max_output_tokens,
        model: req.model.clone().unwrap_or_else(|| model.id.clone()),
        output: Vec::new(),
        parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
        previous_response_id: None,
        reasoning,
        store: false,
        temperature: req.temperature,
        text: json!({"format": format}),
        tool_choice: req.tool_choice.clone().unwrap_or(json!("auto")),
        tools: Vec::new(),
        top_p: req.top_p,
        truncation: "disabled",
        usage: None,
        user: req.user.clone(),
        metadata: req.metadata.clone().unwrap_or_default(),
    }
}

/// What building the output needs.
struct Ctx {
    plan: ResponsesPlan,
    base: ResponseObject,
    model: Arc<ServedModel>,
    seal: crate::seal::ReasoningSeal,
}

/// Item ids by block index, made when a block opens (`rs_…`, `msg_…`, `fc_…`).
#[derive(Default)]
struct ItemIds(Vec<String>);

impl ItemIds {
    fn get(&mut self, index: usize, kind: &BlockKind) -> String {
        while self.0.len() <= index {
            let prefix = match kind {
                BlockKind::Reasoning => "rs",
                BlockKind::Text => "msg",
                BlockKind::ToolCall { .. } => "fc",
            };
            self.0.push(format!("{prefix}_{:032x}", rand::random::<u128>()));
        }
        self.0[index].clone()
    }
}

impl Ctx {
    /// The output item of `block` with `status` (`in_progress` items are empty: their content streams).
    fn item(&self, block: &Block, id: String, status: &str) -> Value {
        let done = status != "in_progress";
        let text = if done { block.text.as_str() } else { "" };
        match &block.kind {
            BlockKind::Reasoning => {
                let mut item = json!({"type": "reasoning", "id": id, "summary": []});
                if done {
                    if self.plan.summary {
                        item["summary"] = json!([{"type": "summary_text", "text": text}]);
                    } else {
                        item["content"] = json!([{"type": "reasoning_text", "text": text}]);
                    }
                    if self.plan.encrypted {
                        item["encrypted_content"] = json!(self.seal.seal(text));
                    }
                }
                item
            }
            BlockKind::Text => {
                let content = if done {
                    json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}])
                } else {
                    json!([])
                };
                json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
            }
            BlockKind::ToolCall { id: call_id, name } => {
                let mut item = json!({"type": "function_call", "id": id, "call_id": call_id, "arguments": text,
                    "status": status});
                match self.plan.namespaced.get(name) {
                    Some((namespace, inner)) => {
                        item["name"] = json!(inner);
                        item["namespace"] = json!(namespace);
                    }
                    None => item["name"] = json!(name),
                }
                item
            }
        }
    }

    /// The final response object: `completed`, or `incomplete` when the token budget ended it.
    fn finished(&self, output: Vec<Value>, blocks: &[Block], finish: FinishReason, usage: Usage) -> ResponseObject {
        let reasoning: String =
            blocks.iter().filter(|b| b.kind == BlockKind::Reasoning).map(|b| b.text.as_str()).collect();
        let reasoning_tokens = if reasoning.is_empty() {
            0
        } else {
            self.model
                .engine
                .tokenizer()
                .encode_plain(&reasoning)
                .map_or(0, |ids| ids.len())
                .min(usage.completion_tokens)
        };
        let mut object = self.base.clone();
        object.status = if finish == FinishReason::Length { "incomplete" } else { "completed" };
        if finish == FinishReason::Length {
            object.incomplete_details = Some(json!({"reason": "max_output_tokens"}));
        }
        object.output = output;
        object.tools = self.plan.tools.clone();
        object.usage = Some(ResponseUsage {
            input_tokens: usage.prompt_tokens,
            input_tokens_details: InputTokensDetails {
                cached_tokens: usage.prompt_tokens_details.cached_tokens,
                cache_write_tokens: 0,
            },
            output_tokens: usage.completion_tokens,
            output_tokens_details: OutputTokensDetails { reasoning_tokens },
            total_tokens: usage.total_tokens,
        });
        object
    }
}

/// The event stream's state.
struct StreamState {
    ctx: Ctx,
    pieces: mpsc::Receiver<(usize, Piece)>,
    tracker: BlockTracker,
    ids: ItemIds,
    sequence: usize,
    output: Vec<Value>,
    blocks: Vec<Block>,
    kinds: Vec<BlockKind>,
    started: bool,
    closed: bool,
}

impl StreamState {
    fn event(&mut self, kind: &str, fields: Value) -> Event {
        let fields = match fields {
            Value::Object(map) => map,
            _ => Map::new(),
        };
        let event = ResponseStreamEvent { kind: kind.to_owned(), sequence_number: self.sequence, fields };
        self.sequence += 1;
        let data = serde_json::to_string(&event)
            .unwrap_or_else(|e| json!({"type": "error", "message": e.to_string()}).to_string());
        Event::default().event(kind).data(data)
    }

    fn events_for(&mut self, event: BlockEvent) -> Vec<Event> {
        let mut out = Vec::new();
        match event {
            BlockEvent::Start { index, kind } => {
                self.kinds.push(kind.clone());
                let id = self.ids.get(index, &kind);
                let empty = Block { kind: kind.clone(), text: String::new() };
                let item = self.ctx.item(&empty, id.clone(), "in_progress");
                out.push(self.event("response.output_item.added", json!({"output_index": index, "item": item})));
                match kind {
                    BlockKind::Text => out.push(self.event(
                        "response.content_part.added",
                        json!({"item_id": id, "output_index": index, "content_index": 0,
                            "part": {"type": "output_text", "text": "", "annotations": []}}),
                    )),
                    BlockKind::Reasoning if self.ctx.plan.summary => out.push(self.event(
                        "response.reasoning_summary_part.added",
                        json!({"item_id": id, "output_index": index, "summary_index": 0,
                            "part": {"type": "summary_text", "text": ""}}),
                    )),
                    BlockKind::Reasoning => out.push(self.event(
                        "response.content_part.added",
                        json!({"item_id": id, "output_index": index, "content_index": 0,
                            "part": {"type": "reasoning_text", "text": ""}}),
                    )),
                    BlockKind::ToolCall { .. } => {}
                }
            }
            BlockEvent::Delta { index, text } => {
                let Some(kind) = self.open_kind(index) else { return out };
                let id = self.ids.get(index, &kind);
                let (name, fields) = match kind {
                    BlockKind::Text => (
                        "response.output_text.delta",
                        json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text, "logprobs": []}),
                    ),
                    BlockKind::Reasoning if self.ctx.plan.summary => (
                        "response.reasoning_summary_text.delta",
                        json!({"item_id": id, "output_index": index, "summary_index": 0, "delta": text}),
                    ),
                    BlockKind::Reasoning => (
                        "response.reasoning_text.delta",
                        json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text}),
                    ),
                    BlockKind::ToolCall { .. } => (
                        "response.function_call_arguments.delta",
                        json!({"item_id": id, "output_index": index, "delta": text}),
                    ),
                };
                out.push(self.event(name, fields));
            }
            BlockEvent::Stop { index, block } => {
                let id = self.ids.get(index, &block.kind);
                let item = self.ctx.item(&block, id.clone(), "completed");
                match &block.kind {
                    BlockKind::Text => {
                        let part = item["content"][0].clone();
                        out.push(self.event(
                            "response.output_text.done",
                            json!({"item_id": id, "output_index": index, "content_index": 0, "text": block.text,
                                "logprobs": []}),
                        ));
                        out.push(self.event(
                            "response.content_part.done",
                            json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                        ));
                    }
                    BlockKind::Reasoning if self.ctx.plan.summary => {
                        out.push(self.event(
                            "response.reasoning_summary_text.done",
                            json!({"item_id": id, "output_index": index, "summary_index": 0, "text": block.text}),
                        ));
                        out.push(self.event(
                            "response.reasoning_summary_part.done",
                            json!({"item_id": id, "output_index": index, "summary_index": 0,
                                "part": {"type": "summary_text", "text": block.text}}),
                        ));
                    }
                    BlockKind::Reasoning => {
                        out.push(self.event(
                            "response.reasoning_text.done",
                            json!({"item_id": id, "output_index": index, "content_index": 0, "text": block.text}),
                        ));
                        out.push(self.event(
                            "response.content_part.done",
                            json!({"item_id": id, "output_index": index, "content_index": 0,
                                "part": {"type": "reasoning_text", "text": block.text}}),
                        ));
                    }
                    BlockKind::ToolCall { .. } => {
                        let name = item["name"].clone();
                        out.push(self.event(
                            "response.function_call_arguments.done",
                            json!({"item_id": id, "output_index": index, "name": name, "arguments": block.text}),
                        ));
                    }
                }
                out.push(self.event("response.output_item.done", json!({"output_index": index, "item": item})));
                self.output.push(item);
                self.blocks.push(block);
            }
            BlockEvent::Done { finish_reason, usage, .. } => {
                let output = std::mem::take(&mut self.output);
                let object = self.ctx.finished(output, &self.blocks, finish_reason, usage);
                let name = if object.status == "incomplete" { "response.incomplete" } else { "response.completed" };
                out.push(self.event(name, json!({"response": object})));
                self.closed = true;
            }
            BlockEvent::Failed(message) => {
                out.push(self.failed(&message));
            }
        }
        out
    }

    /// The kind of block `index` (recorded at its `Start`, which comes before its deltas).
    fn open_kind(&self, index: usize) -> Option<BlockKind> {
        self.kinds.get(index).cloned()
    }

    fn failed(&mut self, message: &str) -> Event {
        let mut object = self.ctx.base.clone();
        object.status = "failed";
        object.error = Some(json!({"code": "server_error", "message": format!("generation failed: {message}")}));
        object.output = std::mem::take(&mut self.output);
        self.closed = true;
        self.event("response.failed", json!({"response": object}))
    }
}

/// The SSE response of a streamed response.
fn response_sse(ctx: Ctx, pieces: mpsc::Receiver<(usize, Piece)>, keepalive: Duration) -> impl IntoResponse {
    let state = StreamState {
        ctx,
        pieces,
        tracker: BlockTracker::new(Vec::new()),
        ids: ItemIds::default(),
        sequence: 0,
        output: Vec::new(),
        blocks: Vec::new(),
        kinds: Vec::new(),
        started: false,
        closed: false,
    };
    let events = stream::unfold(state, |mut st| async move {
        if st.closed {
            return None;
        }
        if !st.started {
            st.started = true;
            let base = st.ctx.base.clone();
            let created = st.event("response.created", json!({"response": base}));
            let base = st.ctx.base.clone();
            let in_progress = st.event("response.in_progress", json!({"response": base}));
            return Some((vec![created, in_progress], st));
        }
        let events = match st.pieces.recv().await {
            Some((_, piece)) => {
                let mut events = Vec::new();
                for e in st.tracker.push(piece) {
                    events.extend(st.events_for(e));
                }
                events
            }
            None => vec![st.failed("the generation ended unexpectedly")],
        };
        Some((events, st))
    })
    .flat_map(stream::iter)
    .map(Ok::<_, Infallible>);
    Sse::new(events).keep_alive(KeepAlive::new().interval(keepalive).text("keep-alive"))
}
