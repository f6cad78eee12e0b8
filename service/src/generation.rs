//! From engine events to message pieces: one task per request decodes the generated ids to text (never half a
//! UTF-8 character), cuts the text at the request's stop strings, and splits it into reasoning, answer and tool
//! calls with the engine's streaming [`OutputParser`]. Streamed and non-streamed responses both read the
//! [`Piece`]s this task sends.
//!
//! Cancellation flows one way: when the reader of the pieces goes away (the client disconnected and its response
//! was dropped), the task stops at once and drops the engine's event receiver, which the engine checks before
//! every decode step and between prefill chunks.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use nebula_engine::text::output::{OutputEvent, OutputParser, ParseOptions};
use nebula_engine::worker::{self, GenerateRequest, GenerationEvent, SubmitError};
use tokio::sync::mpsc;

use crate::error::ApiError;
use crate::openai::{FinishReason, Usage};
use crate::state::ServedModel;

/// How many pieces may wait for a slow reader before the task waits too.
const PIECE_BUFFER: usize = 64;

/// What the model wrote, in order. The last piece is [`Piece::Done`] or [`Piece::Failed`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// More reasoning text.
    Reasoning(String),
    /// More answer text.
    Content(String),
    /// A whole tool call.
    ToolCall {
        /// Position of the call in the turn.
        index: usize,
        /// Unique id of the call.
        id: String,
        /// Function name.
        name: String,
        /// Arguments object as a JSON string.
        arguments: String,
    },
    /// Generation ended.
    Done {
        /// Why.
        finish_reason: FinishReason,
        /// Token counts.
        usage: Usage,
    },
    /// Generation failed after it started; the message says why.
    Failed(String),
}

/// A request ready for the engine, and how to read its output.
#[derive(Debug)]
pub struct Generation {
    /// What the engine runs.
    pub request: GenerateRequest,
    /// How to split the output (reasoning first when the prompt opened `<think>`, tool schemas).
    pub parse: ParseOptions,
    /// Strings that end generation when they appear in the text (not returned).
    pub stop: Vec<String>,
}

/// Queues `generation` on the model's engine and starts the task that turns its events into pieces.
///
/// Errors: 429 when the queue is full, 400 for a prompt the engine refuses, 500 when the engine has stopped.
pub fn start(model: &Arc<ServedModel>, generation: Generation) -> Result<mpsc::Receiver<Piece>, ApiError> {
    let Generation { request, parse, stop } = generation;
    let prompt_tokens = request.prompt.len();
    let cancel = request.cancel.clone();
    let events = model.engine.submit(request).map_err(submit_error)?;
    let (tx, rx) = mpsc::channel(PIECE_BUFFER);
    let model = model.clone();
    tokio::spawn(async move {
        drive(&model, events, &parse, stop, prompt_tokens, &tx).await;
        // Whatever ended the task, the engine must not keep generating for it.
        cancel.store(true, Ordering::Relaxed);
    });
    Ok(rx)
}

fn submit_error(err: SubmitError) -> ApiError {
    match err {
        SubmitError::QueueFull(waiting) => ApiError::QueueFull { waiting, retry_after_s: 1 },
        SubmitError::PromptTooLong { prompt_tokens, limit } => ApiError::invalid_with_code(
            format!(
                "This model's maximum context length is {limit} tokens, but the prompt has {prompt_tokens} tokens. \
                 Shorten the messages."
            ),
            Some("messages".into()),
            "context_length_exceeded",
        ),
        SubmitError::EmptyPrompt => ApiError::invalid("The rendered prompt is empty.", "messages"),
        SubmitError::Sampling(message) => ApiError::InvalidRequest { message, param: None, code: None },
        SubmitError::BadToken(id) => {
            ApiError::Internal(format!("the prompt encoded to token id {id}, outside the model"))
        }
        SubmitError::Stopped => ApiError::Internal("the engine has stopped".into()),
    }
}

/// Reads the engine's events until the generation ends or the reader goes away.
async fn drive(
    model: &ServedModel,
    mut events: mpsc::UnboundedReceiver<GenerationEvent>,
    parse: &ParseOptions,
    stop: Vec<String>,
    prompt_tokens: usize,
    tx: &mpsc::Sender<Piece>,
) {
    let mut decoder = model.engine.tokenizer().stream_decoder(true);
    let mut turn = TurnAssembler::new(parse, stop, prompt_tokens);
    loop {
        let event = tokio::select! {
            biased;
            () = tx.closed() => {
                tracing::info!(completion_tokens = turn.completion_tokens, "client went away; generation cancelled");
                return;
            }
            event = events.recv() => event,
        };
        let pieces = match event {
            Some(GenerationEvent::Started) => continue,
            Some(GenerationEvent::Token(id)) => match decoder.push(id) {
                Ok(text) => match turn.push_token(&text) {
                    Ok(pieces) => pieces,
                    // A stop string matched: returning drops `events`, which stops the engine before its next step.
                    Err(last) => {
                        send_all(tx, last).await;
                        return;
                    }
                },
                Err(e) => vec![Piece::Failed(format!("detokenizing the output: {e}"))],
            },
            Some(GenerationEvent::Finished { reason, usage }) => {
                log_usage(&usage, reason);
                let reason = match reason {
                    worker::FinishReason::Length => FinishReason::Length,
                    worker::FinishReason::Stop | worker::FinishReason::Cancelled => FinishReason::Stop,
                };
                send_all(tx, turn.finish(&decoder.finish(), reason)).await;
                return;
            }
            Some(GenerationEvent::Failed(message)) => {
                tracing::error!(%message, "generation failed");
                vec![Piece::Failed(message)]
            }
            None => vec![Piece::Failed("the engine stopped before the generation ended".into())],
        };
        let failed = matches!(pieces.last(), Some(Piece::Failed(_)));
        if !send_all(tx, pieces).await || failed {
            return;
        }
    }
}

/// Sends `pieces` in order; false when the reader is gone.
async fn send_all(tx: &mpsc::Sender<Piece>, pieces: Vec<Piece>) -> bool {
    for piece in pieces {
        if tx.send(piece).await.is_err() {
            return false;
        }
    }
    true
}

/// Builds one assistant turn from decoded text: stop strings first (on the raw text, tags included), then the
/// output parser; counts tokens and decides the finish reason. Synchronous, so it is tested without an engine.
#[derive(Debug)]
pub struct TurnAssembler {
    parser: OutputParser,
    stops: StopMatcher,
    prompt_tokens: usize,
    /// Tokens generated so far.
    pub completion_tokens: usize,
    saw_tool_call: bool,
}

impl TurnAssembler {
    /// A turn read with `parse`, ended early by any of `stop`, after a prompt of `prompt_tokens`.
    pub fn new(parse: &ParseOptions, stop: Vec<String>, prompt_tokens: usize) -> Self {
        Self {
            parser: OutputParser::new(parse),
            stops: StopMatcher::new(stop),
            prompt_tokens,
            completion_tokens: 0,
            saw_tool_call: false,
        }
    }

    /// Adds the text of one generated token. `Err` holds the last pieces (ending with [`Piece::Done`]) when a
    /// stop string matched: the generation must stop.
    pub fn push_token(&mut self, text: &str) -> Result<Vec<Piece>, Vec<Piece>> {
        self.completion_tokens += 1;
        let (released, matched) = self.stops.push(text);
        let events = self.parser.push(&released);
        let mut pieces = self.pieces(events);
        if !matched {
            return Ok(pieces);
        }
        pieces.extend(self.end(FinishReason::Stop));
        Err(pieces)
    }

    /// Ends the turn: `rest` is the decoder's held-back text, `reason` why the engine stopped. The last piece is
    /// [`Piece::Done`]; a turn that called tools and ended normally finishes with `tool_calls`.
    pub fn finish(mut self, rest: &str, reason: FinishReason) -> Vec<Piece> {
        let (mut released, matched) = self.stops.push(rest);
        if !matched {
            released.push_str(&self.stops.finish());
        }
        let events = self.parser.push(&released);
        let mut pieces = self.pieces(events);
        pieces.extend(self.end(if matched { FinishReason::Stop } else { reason }));
        pieces
    }

    fn end(&mut self, reason: FinishReason) -> Vec<Piece> {
        let parser = std::mem::replace(&mut self.parser, OutputParser::new(&ParseOptions::default()));
        let mut pieces = self.pieces(parser.finish());
        let finish_reason =
            if self.saw_tool_call && reason == FinishReason::Stop { FinishReason::ToolCalls } else { reason };
        pieces.push(Piece::Done { finish_reason, usage: Usage::new(self.prompt_tokens, self.completion_tokens) });
        pieces
    }

    fn pieces(&mut self, events: Vec<OutputEvent>) -> Vec<Piece> {
        events
            .into_iter()
            .map(|event| match event {
                OutputEvent::Reasoning(text) => Piece::Reasoning(text),
                OutputEvent::Content(text) => Piece::Content(text),
                OutputEvent::ToolCall { index, id, name, arguments } => {
                    self.saw_tool_call = true;
                    Piece::ToolCall { index, id, name, arguments }
                }
            })
            .collect()
    }
}

fn log_usage(usage: &worker::Usage, reason: worker::FinishReason) {
    let decode_tokens = usage.completion_tokens.saturating_sub(1);
    let decode_tok_s = if usage.decode_ms > 0.0 { decode_tokens as f64 / (usage.decode_ms / 1e3) } else { 0.0 };
    let prefill_tok_s =
        if usage.prefill_ms > 0.0 { usage.prompt_tokens as f64 / (usage.prefill_ms / 1e3) } else { 0.0 };
    tracing::info!(
        ?reason,
        prompt_tokens = usage.prompt_tokens,
        completion_tokens = usage.completion_tokens,
        queue_ms = format_args!("{:.1}", usage.queue_ms),
        prefill_ms = format_args!("{:.1}", usage.prefill_ms),
        decode_ms = format_args!("{:.1}", usage.decode_ms),
        prefill_tok_s = format_args!("{prefill_tok_s:.1}"),
        decode_tok_s = format_args!("{decode_tok_s:.1}"),
        "generation finished"
    );
}

/// Finds the first of a request's stop strings in streamed text. Text that may be the start of a stop string is
/// held back until the next text decides; on a match, the text before it is released and the rest dropped.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        Self { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new() }
    }

    /// Adds `text`; returns the text that is certainly not part of a stop string, and whether one matched (then
    /// nothing after the match is ever released).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.stops.is_empty() {
            return (text.to_owned(), false);
        }
        self.held.push_str(text);
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            self.held.truncate(at);
            return (std::mem::take(&mut self.held), true);
        }
        let keep = self
            .stops
            .iter()
            .map(|stop| {
                stop.char_indices()
                    .map(|(i, _)| i)
                    .skip(1)
                    .filter(|&len| self.held.ends_with(&stop[..len]))
                    .max()
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0);
        let release = self.held.len() - keep;
        let rest = self.held.split_off(release);
        (std::mem::replace(&mut self.held, rest), false)
    }

    /// Releases the text held back (the output ended without a match).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let (text, hit) = m.push(p);
            out.push_str(&text);
            if hit {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stop_strings_split_across_pieces() {
        assert_eq!(run(&["STOP"], &["abc ST", "O", "P after"]), ("abc ".into(), true));
        assert_eq!(run(&["STOP"], &["abc ST", "x"]), ("abc STx".into(), false));
        assert_eq!(run(&["STOP"], &["ends with ST"]), ("ends with ST".into(), false));
        assert_eq!(run(&["b", "abc"], &["xab", "c"]), ("xa".into(), true));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&["é!"], &["caf", "é", "!"]), ("caf".into(), true));
    }

    /// Feeds `tokens` (decoded texts) to a turn whose prompt opened `<think>`; returns all pieces.
    fn assemble(tokens: &[&str], stop: &[&str], reason: FinishReason) -> Vec<Piece> {
        let parse = ParseOptions { starts_in_reasoning: true, call_id_prefix: "call_t_".into(), ..Default::default() };
        let mut turn = TurnAssembler::new(&parse, stop.iter().map(|s| s.to_string()).collect(), 10);
        let mut out = Vec::new();
        for t in tokens {
            match turn.push_token(t) {
                Ok(pieces) => out.extend(pieces),
                Err(last) => {
                    out.extend(last);
                    return out;
                }
            }
        }
        out.extend(turn.finish("", reason));
        out
    }

    fn text_of(pieces: &[Piece]) -> (String, String) {
        let mut reasoning = String::new();
        let mut content = String::new();
        for p in pieces {
            match p {
                Piece::Reasoning(t) => reasoning.push_str(t),
                Piece::Content(t) => content.push_str(t),
                _ => {}
            }
        }
        (reasoning, content)
    }

    #[test]
    fn turn_splits_reasoning_and_answer() {
        let pieces = assemble(&["Think", "ing.", "\n</think>", "\n\n", "Hi", " there."], &[], FinishReason::Stop);
        assert_eq!(text_of(&pieces), ("Thinking.".into(), "Hi there.".into()));
        assert_eq!(pieces.last(), Some(&Piece::Done { finish_reason: FinishReason::Stop, usage: Usage::new(10, 6) }));
    }

    #[test]
    fn tool_calls_finish_with_tool_calls() {
        let tokens = [
            "Need weather.\n</think>\n\n",
            "<tool_call>",
            "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n",
            "</tool_call>",
        ];
        let pieces = assemble(&tokens, &[], FinishReason::Stop);
        let call = pieces.iter().find(|p| matches!(p, Piece::ToolCall { .. })).expect("a tool call");
        assert_eq!(
            call,
            &Piece::ToolCall {
                index: 0,
                id: "call_t_0".into(),
                name: "get_weather".into(),
                arguments: "{\"city\": \"Paris\"}".into()
            }
        );
        assert!(matches!(pieces.last(), Some(Piece::Done { finish_reason: FinishReason::ToolCalls, .. })));
        // Cut off by max_tokens, the turn reports length even after a call.
        let pieces = assemble(&tokens, &[], FinishReason::Length);
        assert!(matches!(pieces.last(), Some(Piece::Done { finish_reason: FinishReason::Length, .. })));
    }

    #[test]
    fn stop_string_ends_the_turn_and_counts_tokens_up_to_it() {
        let pieces = assemble(&["a\n</think>\n\n", "one ", "two", " three", " four"], &["two"], FinishReason::Length);
        assert_eq!(text_of(&pieces), ("a".into(), "one".into()));
        assert_eq!(pieces.last(), Some(&Piece::Done { finish_reason: FinishReason::Stop, usage: Usage::new(10, 3) }));
    }

    #[test]
    fn held_text_is_only_a_stop_prefix() {
        let mut m = StopMatcher::new(vec!["<END>".into()]);
        assert_eq!(m.push("hello <E"), ("hello ".into(), false));
        assert_eq!(m.push("ND"), (String::new(), false));
        assert_eq!(m.push("X"), ("<ENDX".into(), false));
    }
}
