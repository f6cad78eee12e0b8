//! Server-sent events of a streamed chat completion, in OpenAI's order: a first chunk with `delta.role`, one chunk
//! per piece (`delta.reasoning_content`, `delta.content`, `delta.tool_calls`), a chunk with an empty delta and the
//! `finish_reason`, with `stream_options.include_usage` a chunk with `choices: []` and the usage, then
//! `data: [DONE]`. Every chunk but the usage chunk has `usage: null`. An error after the stream began is sent as
//! an `{"error": ...}` event, then `[DONE]`.
//!
//! The stream owns the piece receiver: when the client disconnects, axum drops the stream, the receiver goes
//! with it and the generation task cancels the request.

use std::convert::Infallible;

use axum::response::sse::{Event, KeepAlive, Sse};
use futures_util::stream::{self, Stream, StreamExt};
use tokio::sync::mpsc;

use crate::error::ApiError;
use crate::generation::Piece;
use crate::openai::{ChatCompletionChunk, ChunkChoice, Delta, FunctionCall, ToolCallDelta};

/// What every chunk of one completion repeats.
#[derive(Debug, Clone)]
pub struct ChunkMeta {
    /// `chatcmpl-…`.
    pub id: String,
    /// Unix time of the request, seconds.
    pub created: u64,
    /// The served model id.
    pub model: String,
    /// Send the final usage chunk.
    pub include_usage: bool,
}

impl ChunkMeta {
    fn chunk(&self, delta: Delta, finish_reason: Option<crate::openai::FinishReason>) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices: vec![ChunkChoice { index: 0, delta, finish_reason, logprobs: None }],
            usage: None,
        }
    }
}

enum Phase {
    Start,
    Open,
    Closed,
}

/// The SSE response for `pieces`.
pub fn sse_response(
    meta: ChunkMeta,
    pieces: mpsc::Receiver<Piece>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>> + Send + 'static> {
    let events = stream::unfold((Phase::Start, meta, pieces), |(phase, meta, mut pieces)| async move {
        match phase {
            Phase::Closed => None,
            Phase::Start => {
                let first = Delta { role: Some("assistant"), content: Some(String::new()), ..Delta::default() };
                let events = vec![json_event(&meta.chunk(first, None))];
                Some((events, (Phase::Open, meta, pieces)))
            }
            Phase::Open => {
                let (events, phase) = match pieces.recv().await {
                    Some(piece) => piece_events(&meta, piece),
                    None => (error_events("the generation ended unexpectedly"), Phase::Closed),
                };
                Some((events, (phase, meta, pieces)))
            }
        }
    })
    .flat_map(stream::iter)
    .map(Ok);
    Sse::new(events).keep_alive(KeepAlive::default())
}

fn piece_events(meta: &ChunkMeta, piece: Piece) -> (Vec<Event>, Phase) {
    let delta = match piece {
        Piece::Reasoning(text) => Delta { reasoning_content: Some(text), ..Delta::default() },
        Piece::Content(text) => Delta { content: Some(text), ..Delta::default() },
        Piece::ToolCall { index, id, name, arguments } => Delta {
            tool_calls: Some(vec![ToolCallDelta {
                index,
                id,
                kind: "function",
                function: FunctionCall { name, arguments },
            }]),
            ..Delta::default()
        },
        Piece::Done { finish_reason, usage } => {
            let mut events = vec![json_event(&meta.chunk(Delta::default(), Some(finish_reason)))];
            if meta.include_usage {
                let mut last = meta.chunk(Delta::default(), None);
                last.choices.clear();
                last.usage = Some(usage);
                events.push(json_event(&last));
            }
            events.push(Event::default().data("[DONE]"));
            return (events, Phase::Closed);
        }
        Piece::Failed(message) => return (error_events(&message), Phase::Closed),
    };
    (vec![json_event(&meta.chunk(delta, None))], Phase::Open)
}

fn error_events(message: &str) -> Vec<Event> {
    let body = ApiError::Internal(format!("generation failed: {message}")).body();
    vec![json_event(&body), Event::default().data("[DONE]")]
}

fn json_event(value: &impl serde::Serialize) -> Event {
    match serde_json::to_string(value) {
        Ok(text) => Event::default().data(text),
        // Our own types always serialize; keep the stream well-formed regardless.
        Err(e) => Event::default()
            .data(serde_json::json!({"error": {"message": format!("serialization failed: {e}")}}).to_string()),
    }
}
