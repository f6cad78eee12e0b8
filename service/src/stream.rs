//! Server-sent events of streamed completions, in OpenAI's order. For a chat completion: per choice, a first
//! chunk with `delta.role`, one chunk per piece (`delta.reasoning_content`, `delta.content`, `delta.tool_calls`),
//! a chunk with an empty delta, the `finish_reason` and llama.cpp `timings`; then, with
//! `stream_options.include_usage`, a chunk with `choices: []` and the usage of all choices; then `data: [DONE]`.
//! Every chunk but the usage chunk has `usage: null`. Text completions follow the same order with `text`.
//!
//! A tool call streams as it is written: a header (`id`, `type`, `function.name`, empty `arguments`) once the
//! model has written `<function=NAME>`, then one argument fragment per parameter as each `</parameter>` arrives
//! (`{"city": "Paris"`, `, "unit": "c"`) and the closing `}`, so the fragments of a call always concatenate to its
//! `arguments` in the non-streamed response (a call cut off by `max_tokens` stays open as written, with
//! `finish_reason: "length"`, as on OpenAI). Log-probabilities ride on the chunk of the text they belong to.
//!
//! Past the shutdown grace period every open stream gets an error event, then `[DONE]`.
//!
//! While the engine prefills a long prompt nothing is sent but SSE comments (`: keep-alive`), every
//! `sse_keepalive_s`. An error after the stream began is sent as an `{"error": ...}` event, then `[DONE]`.
//!
//! The stream owns the piece receiver: when the client disconnects, axum drops the stream, the receiver goes
//! with it and the generation task cancels the request.

use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{Map, Value};
use tokio::sync::mpsc;

use crate::error::ApiError;
use crate::generation::Piece;
use crate::openai::{
    ChatCompletionChunk, ChoiceLogprobs, ChunkChoice, Completion, CompletionChoice, CompletionLogprobs, Delta,
    FunctionCallDelta, ToolCallDelta, Usage,
};

/// What every chunk of one completion repeats.
#[derive(Debug, Clone)]
pub struct ChunkMeta {
    /// `chatcmpl-…` / `cmpl-…`.
    pub id: String,
    /// Unix time of the request, seconds.
    pub created: u64,
    /// The served model id.
    pub model: String,
    /// Send the final usage chunk.
    pub include_usage: bool,
    /// Choices expected.
    pub n: usize,
    /// Seconds between keep-alive comments.
    pub keepalive: Duration,
}

/// Splits a tool call's arguments object (a JSON object string) into fragments, one per member, that
/// concatenate to the same text: `{"a": 1`, `, "b": 2`, `}`; `{}` stays whole.
pub fn argument_fragments(arguments: &str) -> Vec<String> {
    let Ok(Value::Object(map)) = serde_json::from_str::<Value>(arguments) else {
        return vec![arguments.to_owned()];
    };
    if map.is_empty() {
        return vec![arguments.to_owned()];
    }
    let mut out = Vec::with_capacity(map.len() + 1);
    for (i, (k, v)) in map.into_iter().enumerate() {
        let mut one = Map::new();
        one.insert(k, v);
        let member = nebula_engine::text::chat_template::python_json(&Value::Object(one));
        let inner = &member[1..member.len() - 1];
        out.push(if i == 0 { format!("{{{inner}") } else { format!(", {inner}") });
    }
    out.push("}".into());
    if out.concat() != arguments {
        // Not in the canonical form: send it whole rather than risk a different text.
        return vec![arguments.to_owned()];
    }
    out
}

struct ChatState {
    meta: ChunkMeta,
    pieces: mpsc::Receiver<(usize, Piece)>,
    pending_logprobs: Vec<crate::openai::TokenLogprob>,
    started: Vec<bool>,
    done: usize,
    usage: Option<Usage>,
    closed: bool,
}

impl ChatState {
    fn chunk(&mut self, index: usize, delta: Delta, finish: Option<crate::openai::FinishReason>) -> Event {
        let logprobs = (!self.pending_logprobs.is_empty())
            .then(|| ChoiceLogprobs { content: std::mem::take(&mut self.pending_logprobs) });
        json_event(&ChatCompletionChunk {
            id: self.meta.id.clone(),
            object: "chat.completion.chunk",
            created: self.meta.created,
            model: self.meta.model.clone(),
            choices: vec![ChunkChoice { index, delta, finish_reason: finish, logprobs }],
            usage: None,
            timings: None,
        })
    }

    fn events_for(&mut self, index: usize, piece: Piece) -> Vec<Event> {
        let mut events = Vec::new();
        if !self.started.get(index).copied().unwrap_or(true) {
            self.started[index] = true;
            let first = Delta { role: Some("assistant"), content: Some(String::new()), ..Delta::default() };
            let logprobs = std::mem::take(&mut self.pending_logprobs);
            events.push(self.chunk(index, first, None));
            self.pending_logprobs = logprobs;
        }
        match piece {
            Piece::Progress => {}
            Piece::Logprob(lp) => self.pending_logprobs.push(lp),
            Piece::Reasoning(text) => {
                events.push(self.chunk(index, Delta { reasoning_content: Some(text), ..Delta::default() }, None));
            }
            Piece::Content(text) => {
                events.push(self.chunk(index, Delta { content: Some(text), ..Delta::default() }, None));
            }
            Piece::ToolCall { index: call, id, name, arguments } => {
                let header = ToolCallDelta {
                    index: call,
                    id: Some(id),
                    kind: Some("function"),
                    function: FunctionCallDelta { name: Some(name), arguments: String::new() },
                };
                events.push(self.chunk(index, Delta { tool_calls: Some(vec![header]), ..Delta::default() }, None));
                for fragment in argument_fragments(&arguments) {
                    let part = ToolCallDelta {
                        index: call,
                        id: None,
                        kind: None,
                        function: FunctionCallDelta { name: None, arguments: fragment },
                    };
                    events.push(self.chunk(index, Delta { tool_calls: Some(vec![part]), ..Delta::default() }, None));
                }
            }
            Piece::ToolCallStart { index: call, id, name } => {
                let header = ToolCallDelta {
                    index: call,
                    id: Some(id),
                    kind: Some("function"),
                    function: FunctionCallDelta { name: Some(name), arguments: String::new() },
                };
                events.push(self.chunk(index, Delta { tool_calls: Some(vec![header]), ..Delta::default() }, None));
            }
            Piece::ToolCallArguments { index: call, fragment } => {
                let part = ToolCallDelta {
                    index: call,
                    id: None,
                    kind: None,
                    function: FunctionCallDelta { name: None, arguments: fragment },
                };
                events.push(self.chunk(index, Delta { tool_calls: Some(vec![part]), ..Delta::default() }, None));
            }
            Piece::Done { finish_reason, usage, timings } => {
                let logprobs = (!self.pending_logprobs.is_empty())
                    .then(|| ChoiceLogprobs { content: std::mem::take(&mut self.pending_logprobs) });
                let last = json_event(&ChatCompletionChunk {
                    id: self.meta.id.clone(),
                    object: "chat.completion.chunk",
                    created: self.meta.created,
                    model: self.meta.model.clone(),
                    choices: vec![ChunkChoice {
                        index,
                        delta: Delta::default(),
                        finish_reason: Some(finish_reason),
                        logprobs,
                    }],
                    usage: None,
                    timings: Some(timings),
                });
                events.push(last);
                self.usage = Some(match self.usage {
                    None => usage,
                    Some(total) => {
                        let mut sum =
                            Usage::new(total.prompt_tokens, total.completion_tokens + usage.completion_tokens);
                        sum.prompt_tokens_details = total.prompt_tokens_details;
                        sum
                    }
                });
                self.done += 1;
                if self.done == self.meta.n {
                    if self.meta.include_usage {
                        events.push(json_event(&ChatCompletionChunk {
                            id: self.meta.id.clone(),
                            object: "chat.completion.chunk",
                            created: self.meta.created,
                            model: self.meta.model.clone(),
                            choices: Vec::new(),
                            usage: self.usage,
                            timings: None,
                        }));
                    }
                    events.push(Event::default().data("[DONE]"));
                    self.closed = true;
                }
            }
            Piece::Failed(message) => {
                events.extend(error_events(&message));
                self.closed = true;
            }
        }
        events
    }
}

/// The SSE response of a chat completion with `meta.n` choices.
pub fn chat_sse(
    meta: ChunkMeta,
    pieces: mpsc::Receiver<(usize, Piece)>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>> + Send + 'static> {
    let keepalive = meta.keepalive;
    let n = meta.n;
    let state = ChatState {
        meta,
        pieces,
        pending_logprobs: Vec::new(),
        started: vec![false; n],
        done: 0,
        usage: None,
        closed: false,
    };
    let events = stream::unfold(state, |mut st| async move {
        if st.closed {
            return None;
        }
        let events = match st.pieces.recv().await {
            Some((index, piece)) => st.events_for(index, piece),
            None => {
                st.closed = true;
                error_events("the generation ended unexpectedly")
            }
        };
        Some((events, st))
    })
    .flat_map(stream::iter)
    .map(Ok);
    Sse::new(events).keep_alive(KeepAlive::new().interval(keepalive).text("keep-alive"))
}

/// The SSE response of a text completion with `meta.n` choices (`logprobs` in the legacy shape); with `echo`,
/// each choice's first chunk is the prompt.
pub fn completion_sse(
    meta: ChunkMeta,
    pieces: mpsc::Receiver<(usize, Piece)>,
    echo: Option<String>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>> + Send + 'static> {
    let keepalive = meta.keepalive;
    struct St {
        meta: ChunkMeta,
        pieces: mpsc::Receiver<(usize, Piece)>,
        /// Per choice: logprobs not sent yet, and the character offset of the next token in the choice's text.
        logprobs: Vec<Option<CompletionLogprobs>>,
        offsets: Vec<usize>,
        done: usize,
        usage: Option<Usage>,
        closed: bool,
        echo: Option<String>,
        echoed: Vec<bool>,
    }
    let chunk = |meta: &ChunkMeta, choice: CompletionChoice, usage: Option<Usage>, timings| Completion {
        id: meta.id.clone(),
        object: "text_completion",
        created: meta.created,
        model: meta.model.clone(),
        choices: vec![choice],
        usage,
        timings,
    };
    let echoed = vec![false; meta.n];
    let offsets = vec![echo.as_ref().map_or(0, |p| p.chars().count()); meta.n];
    let logprobs = vec![None; meta.n];
    let state = St { meta, pieces, logprobs, offsets, done: 0, usage: None, closed: false, echo, echoed };
    let events = stream::unfold(state, move |mut st| async move {
        if st.closed {
            return None;
        }
        let mut events = Vec::new();
        match st.pieces.recv().await {
            Some((index, piece)) => {
                if let Some(text) = st.echo.clone()
                    && !st.echoed.get(index).copied().unwrap_or(true)
                {
                    st.echoed[index] = true;
                    let choice = CompletionChoice { index, text, finish_reason: None, logprobs: None };
                    events.push(json_event(&chunk(&st.meta, choice, None, None)));
                }
                match piece {
                    Piece::Logprob(lp) => {
                        if let (Some(slot), Some(offset)) = (st.logprobs.get_mut(index), st.offsets.get_mut(index)) {
                            push_legacy_logprob(slot.get_or_insert_with(CompletionLogprobs::default), &lp, offset);
                        }
                    }
                    Piece::Content(text) | Piece::Reasoning(text) => {
                        let logprobs = st.logprobs.get_mut(index).and_then(Option::take);
                        let choice = CompletionChoice { index, text, finish_reason: None, logprobs };
                        events.push(json_event(&chunk(&st.meta, choice, None, None)));
                    }
                    Piece::ToolCall { .. }
                    | Piece::ToolCallStart { .. }
                    | Piece::ToolCallArguments { .. }
                    | Piece::Progress => {}
                    Piece::Done { finish_reason, usage, timings } => {
                        let choice = CompletionChoice {
                            index,
                            text: String::new(),
                            finish_reason: Some(finish_reason),
                            logprobs: st.logprobs.get_mut(index).and_then(Option::take),
                        };
                        events.push(json_event(&chunk(&st.meta, choice, None, Some(timings))));
                        st.usage = Some(match st.usage {
                            None => usage,
                            Some(t) => Usage::new(t.prompt_tokens, t.completion_tokens + usage.completion_tokens)
                                .with_details(t.prompt_tokens_details),
                        });
                        st.done += 1;
                        if st.done == st.meta.n {
                            if st.meta.include_usage {
                                let mut last = chunk(
                                    &st.meta,
                                    CompletionChoice {
                                        index: 0,
                                        text: String::new(),
                                        finish_reason: None,
                                        logprobs: None,
                                    },
                                    st.usage,
                                    None,
                                );
                                last.choices.clear();
                                events.push(json_event(&last));
                            }
                            events.push(Event::default().data("[DONE]"));
                            st.closed = true;
                        }
                    }
                    Piece::Failed(message) => {
                        events.extend(error_events(&message));
                        st.closed = true;
                    }
                }
            }
            None => {
                events.extend(error_events("the generation ended unexpectedly"));
                st.closed = true;
            }
        }
        Some((events, st))
    })
    .flat_map(stream::iter)
    .map(Ok);
    Sse::new(events).keep_alive(KeepAlive::new().interval(keepalive).text("keep-alive"))
}

/// Appends one token to legacy completion logprobs. `offset` is the character position of the token in the
/// choice's whole `text` (after the prompt when it is echoed; streamed chunks continue where the last one ended,
/// as OpenAI's `text_offset` does); it is advanced past the token.
pub fn push_legacy_logprob(l: &mut CompletionLogprobs, lp: &crate::openai::TokenLogprob, offset: &mut usize) {
    let at = *offset;
    *offset += lp.token.chars().count();
    l.tokens.push(lp.token.clone());
    l.token_logprobs.push(lp.logprob);
    l.top_logprobs.push(lp.top_logprobs.iter().map(|t| (t.token.clone(), Value::from(f64::from(t.logprob)))).collect());
    l.text_offset.push(at);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(n: usize) -> ChunkMeta {
        ChunkMeta {
            id: "chatcmpl-1".into(),
            created: 1,
            model: "m".into(),
            include_usage: true,
            n,
            keepalive: Duration::from_secs(10),
        }
    }

    async fn body_of(response: axum::response::Response) -> Vec<String> {
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap();
        String::from_utf8(bytes.to_vec())
            .unwrap()
            .lines()
            .filter_map(|l| l.strip_prefix("data: ").map(str::to_owned))
            .collect()
    }

    #[tokio::test]
    async fn an_error_after_the_stream_began_is_an_error_event_then_done() {
        use axum::response::IntoResponse;
        let (tx, rx) = mpsc::channel(8);
        tx.send((0, Piece::Content("Hel".into()))).await.unwrap();
        tx.send((0, Piece::Failed("the engine failed".into()))).await.unwrap();
        drop(tx);
        let data = body_of(chat_sse(meta(1), rx).into_response()).await;
        assert_eq!(data.len(), 4, "{data:?}");
        let role: Value = serde_json::from_str(&data[0]).unwrap();
        assert_eq!(role["choices"][0]["delta"]["role"], "assistant");
        let error: Value = serde_json::from_str(&data[2]).unwrap();
        assert_eq!(error["error"]["type"], "server_error");
        assert!(error["error"]["message"].as_str().unwrap().contains("the engine failed"));
        assert_eq!(data[3], "[DONE]");
    }

    #[tokio::test]
    async fn a_stream_cut_short_ends_with_an_error_event() {
        use axum::response::IntoResponse;
        let (tx, rx) = mpsc::channel(8);
        tx.send((0, Piece::Progress)).await.unwrap();
        drop(tx);
        let data = body_of(chat_sse(meta(2), rx).into_response()).await;
        assert!(data[data.len() - 2].contains("\"error\""), "{data:?}");
        assert_eq!(data.last().unwrap(), "[DONE]");
    }

    /// While the engine prefills, the stream sends `: keep-alive` comments. Tokio's paused clock advances only
    /// when every task waits, so this is deterministic.
    #[tokio::test(start_paused = true)]
    async fn keep_alive_comments_flow_while_nothing_else_does() {
        use axum::response::IntoResponse;
        let (tx, rx) = mpsc::channel(8);
        let mut body = chat_sse(meta(1), rx).into_response().into_body().into_data_stream();
        tx.send((0, Piece::Progress)).await.unwrap();
        let first = body.next().await.unwrap().unwrap();
        assert!(String::from_utf8_lossy(&first).contains("\"role\":\"assistant\""));
        // Nothing more from the engine (a long prefill): two keep-alives, ten seconds apart.
        let t0 = tokio::time::Instant::now();
        for _ in 0..2 {
            let frame = body.next().await.unwrap().unwrap();
            assert_eq!(String::from_utf8_lossy(&frame), ": keep-alive\n\n");
        }
        assert!(t0.elapsed() >= Duration::from_secs(20));
        tx.send((
            0,
            Piece::Done {
                finish_reason: crate::openai::FinishReason::Stop,
                usage: Usage::new(3, 0),
                timings: Default::default(),
            },
        ))
        .await
        .unwrap();
        let mut rest = String::new();
        while let Some(frame) = body.next().await {
            rest.push_str(&String::from_utf8_lossy(&frame.unwrap()));
        }
        assert!(rest.ends_with("data: [DONE]\n\n"), "{rest}");
    }

    #[test]
    fn argument_fragments_concatenate_to_the_object() {
        let args = r#"{"city": "Paris", "days": 3, "opts": {"a": [1, 2]}}"#;
        let parts = argument_fragments(args);
        assert_eq!(parts, vec![r#"{"city": "Paris""#, r#", "days": 3"#, r#", "opts": {"a": [1, 2]}"#, "}"]);
        assert_eq!(parts.concat(), args);
        assert_eq!(argument_fragments("{}"), vec!["{}"]);
        assert_eq!(argument_fragments("not json"), vec!["not json"]);
    }
}
