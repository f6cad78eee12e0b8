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
use std::time::{Duration, Instant};

use nebula_engine::sampling::TokenLogprobs;
use nebula_engine::text::output::{OutputEvent, OutputParser, ParseOptions};
use nebula_engine::worker::{self, GenerateRequest, GenerationError, GenerationEvent, SubmitError};
use tokio::sync::mpsc;
use tracing::Instrument;

use crate::error::ApiError;
use crate::metrics::{Metrics, RequestRecord};
use crate::openai::{FinishReason, Timings, TokenLogprob, TopLogprob, Usage};
use crate::state::{SHUTDOWN_MESSAGE, ServedModel};

/// How many pieces may wait for a slow reader before the task waits too.
const PIECE_BUFFER: usize = 64;

/// What the model wrote, in order. The last piece of each choice is [`Piece::Done`] or [`Piece::Failed`].
#[derive(Debug, Clone, PartialEq)]
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
    /// A tool call began (streamed calls): its arguments follow as [`Piece::ToolCallArguments`].
    ToolCallStart {
        /// Position of the call in the turn.
        index: usize,
        /// Unique id of the call.
        id: String,
        /// Function name.
        name: String,
    },
    /// More of a streamed call's arguments; a call's fragments concatenate to its JSON object.
    ToolCallArguments {
        /// Position of the call in the turn.
        index: usize,
        /// The JSON text to append.
        fragment: String,
    },
    /// Log-probabilities of the next generated token (sent before its text).
    Logprob(TokenLogprob),
    /// The engine is still prefilling (a sign of life for keep-alives).
    Progress,
    /// Generation of this choice ended.
    Done {
        /// Why.
        finish_reason: FinishReason,
        /// Token counts of this choice.
        usage: Usage,
        /// Its timings.
        timings: Timings,
    },
    /// Generation failed after it started; the message says why.
    Failed(String),
}

/// How to build a request's grammar constraint (one per choice).
#[derive(Debug, Clone)]
pub struct ConstraintSpec {
    /// The Lark grammar.
    pub lark: String,
    /// The prompt leaves the model thinking: the grammar starts after `</think>`.
    pub starts_in_reasoning: bool,
    /// The request field it comes from (for errors).
    pub param: &'static str,
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
    /// The grammar, if the output is constrained.
    pub constraint: Option<ConstraintSpec>,
    /// The model it runs on.
    pub model: Arc<ServedModel>,
}

/// Service-wide settings a generation task needs.
#[derive(Debug, Clone)]
pub struct DriveSettings {
    /// Fail a generation when the engine says nothing for this long.
    pub watchdog: Duration,
    /// Where to record the request.
    pub metrics: Arc<Metrics>,
    /// When the HTTP request arrived.
    pub arrived: Instant,
    /// Parse the output (chat) or pass the text through (text completions).
    pub chat: bool,
}

/// Queues `n` choices of `generation` on the engine (all at once, so a full queue is a 429 before anything
/// starts) and starts the task that turns their events into `(choice, piece)`s, choice after choice.
///
/// Errors: 429 when the queue is full, 400 for a prompt the engine refuses or a grammar that does not compile,
/// 500 when the engine has stopped.
pub fn start(
    generation: Generation,
    n: usize,
    settings: DriveSettings,
) -> Result<mpsc::Receiver<(usize, Piece)>, ApiError> {
    let Generation { request, parse, stop, constraint, model } = generation;
    if *model.cut_off().borrow() {
        return Err(ApiError::ShuttingDown);
    }
    let mut reqs = Vec::with_capacity(n);
    let mut cancels = Vec::with_capacity(n);
    for i in 0..n {
        let mut req = request.clone();
        req.cancel = Arc::default();
        if let Some(seed) = req.sampling.seed {
            req.sampling.seed = Some(seed.wrapping_add(i as u64));
        }
        if let Some(spec) = &constraint {
            req.constraint = Some(model.grammar()?.constraint(&spec.lark, spec.starts_in_reasoning, spec.param)?);
        }
        cancels.push(req.cancel.clone());
        reqs.push(req);
    }
    // One job: the prompt is prefilled once and the choices decode together in the batch.
    let receivers = model.engine.submit_choices(reqs).map_err(|e| {
        let err = submit_error(e);
        if matches!(err, ApiError::QueueFull { .. }) {
            settings.metrics.rejected("queue_full");
        }
        err
    })?;
    let (tx, rx) = mpsc::channel(PIECE_BUFFER);
    let prompt_tokens = request.prompt.len();
    let image_tokens = request.media.as_ref().map_or(0, |m| m.rows.len());
    let span = tracing::info_span!("generation", model = %model.id, prompt_tokens, choices = n);
    tokio::spawn(
        async move {
            for (i, events) in receivers.into_iter().enumerate() {
                let ok =
                    drive(&model, events, &parse, stop.clone(), (prompt_tokens, image_tokens), &tx, i, &settings).await;
                if !ok {
                    break;
                }
            }
            // Whatever ended the task, the engine must not keep generating for it.
            for c in &cancels {
                c.store(true, Ordering::Relaxed);
            }
        }
        .instrument(span),
    );
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
        e @ SubmitError::StateTooLarge { .. } => {
            ApiError::invalid_with_code(e.to_string(), Some("max_tokens".into()), "context_length_exceeded")
        }
    }
}

/// The OpenAI logprob entry of token `id`.
pub fn token_logprob(model: &ServedModel, id: u32, lp: &TokenLogprobs) -> TokenLogprob {
    let text = |id: u32| {
        let bytes = model.engine.tokenizer().token_bytes(id).unwrap_or_default().to_vec();
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    };
    let (token, bytes) = text(id);
    TokenLogprob {
        token,
        logprob: lp.logprob,
        bytes: Some(bytes),
        top_logprobs: lp
            .top
            .iter()
            .map(|&(t, logprob)| {
                let (token, bytes) = text(t);
                TopLogprob { token, logprob, bytes: Some(bytes) }
            })
            .collect(),
    }
}

/// Reads one choice's events until it ends or the reader goes away; false when nothing more should run.
#[allow(clippy::too_many_arguments)]
async fn drive(
    model: &ServedModel,
    mut events: mpsc::UnboundedReceiver<GenerationEvent>,
    parse: &ParseOptions,
    stop: Vec<String>,
    (prompt_tokens, image_tokens): (usize, usize),
    tx: &mpsc::Sender<(usize, Piece)>,
    choice: usize,
    settings: &DriveSettings,
) -> bool {
    let mut decoder = model.engine.tokenizer().stream_decoder(true);
    let mut turn = TurnAssembler::new(parse, stop, prompt_tokens);
    turn.image_tokens = image_tokens;
    turn.raw = !settings.chat;
    let metrics = &settings.metrics;
    let mut queue_span = Some(tracing::info_span!("queue", choice));
    let mut prefill_span = None;
    let mut decode_span = None;
    let mut first_token: Option<Instant> = None;
    let mut last_token: Option<Instant> = None;
    let mut cached_tokens = 0;
    let send = |pieces: Vec<Piece>| send_all(tx, choice, pieces);
    let mut cut_off = model.cut_off();
    let cut = async move {
        if cut_off.wait_for(|cut| *cut).await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    tokio::pin!(cut);
    loop {
        let event = tokio::select! {
            biased;
            () = tx.closed() => {
                tracing::info!(completion_tokens = turn.completion_tokens, "client went away; generation cancelled");
                return false;
            }
            // Past the shutdown grace period: the reader learns why it ends (an error event and `[DONE]` in a
            // stream); returning drops `events`, which stops the engine.
            () = &mut cut => {
                tracing::warn!(completion_tokens = turn.completion_tokens, "generation stopped: shutdown grace period over");
                send(vec![Piece::Failed(SHUTDOWN_MESSAGE.to_owned())]).await;
                return false;
            }
            // The watchdog runs once the request left the queue: waiting behind others is not being stuck.
            event = async {
                if queue_span.is_some() { Ok(events.recv().await) } else { tokio::time::timeout(settings.watchdog, events.recv()).await }
            } => match event {
                Ok(event) => event,
                Err(_) => {
                    let message = format!(
                        "the engine made no progress for {:.0} s; the request was stopped (watchdog)",
                        settings.watchdog.as_secs_f64()
                    );
                    tracing::error!(%message);
                    metrics.error("watchdog");
                    send(vec![Piece::Failed(message)]).await;
                    return false;
                }
            },
        };
        let pieces = match event {
            Some(GenerationEvent::Started { cached_tokens: cached }) => {
                cached_tokens = cached;
                queue_span = None;
                prefill_span = Some(tracing::info_span!("prefill", choice, cached_tokens = cached));
                vec![Piece::Progress]
            }
            Some(GenerationEvent::Prefilled { .. }) => vec![Piece::Progress],
            Some(GenerationEvent::Token { id, logprobs }) => {
                let now = Instant::now();
                if first_token.is_none() {
                    first_token = Some(now);
                    prefill_span = None;
                    decode_span = Some(tracing::info_span!("decode", choice));
                }
                if let Some(prev) = last_token {
                    metrics.inter_token(&model.id, (now - prev).as_secs_f64());
                }
                last_token = Some(now);
                let mut pieces: Vec<Piece> =
                    logprobs.map(|lp| Piece::Logprob(token_logprob(model, id, &lp))).into_iter().collect();
                match decoder.push(id) {
                    Ok(text) => match turn.push_token(&text) {
                        Ok(more) => pieces.extend(more),
                        // A stop string matched: returning drops `events`, which stops the engine before its
                        // next step.
                        Err(last) => {
                            pieces.extend(last);
                            let (reason, record) =
                                record_of(&pieces, settings, first_token, None, cached_tokens, prompt_tokens);
                            metrics.finished(&model.id, reason, &record);
                            return send(with_timings(pieces, cached_tokens, None)).await;
                        }
                    },
                    Err(e) => pieces.push(Piece::Failed(format!("detokenizing the output: {e}"))),
                }
                pieces
            }
            Some(GenerationEvent::Finished { reason, usage }) => {
                log_usage(&usage, reason);
                let finish = match reason {
                    worker::FinishReason::Length | worker::FinishReason::Repetition => FinishReason::Length,
                    worker::FinishReason::Stop | worker::FinishReason::Cancelled => FinishReason::Stop,
                };
                if reason == worker::FinishReason::Repetition {
                    tracing::warn!("the repetition guard ended a looping output");
                }
                let pieces = turn.finish(&decoder.finish(), finish);
                let (name, record) =
                    record_of(&pieces, settings, first_token, Some(&usage), cached_tokens, prompt_tokens);
                metrics.finished(&model.id, name, &record);
                drop((queue_span.take(), prefill_span.take(), decode_span.take()));
                return send(with_timings(pieces, cached_tokens, Some(&usage))).await;
            }
            Some(GenerationEvent::Failed(error)) => {
                tracing::error!(%error, "generation failed");
                metrics.error(match error {
                    GenerationError::Constraint(_) => "constraint",
                    GenerationError::Backend(_) | GenerationError::Internal(_) => "engine",
                });
                vec![Piece::Failed(error.to_string())]
            }
            None => {
                metrics.error("engine");
                vec![Piece::Failed("the engine stopped before the generation ended".into())]
            }
        };
        let failed = matches!(pieces.last(), Some(Piece::Failed(_)));
        if !send(pieces).await || failed {
            return false;
        }
    }
}

/// The finish reason's name and the metrics record of a finished choice.
fn record_of(
    pieces: &[Piece],
    settings: &DriveSettings,
    first_token: Option<Instant>,
    usage: Option<&worker::Usage>,
    cached_tokens: usize,
    prompt_tokens: usize,
) -> (&'static str, RequestRecord) {
    let (reason, completion) = match pieces.last() {
        Some(Piece::Done { finish_reason, usage, .. }) => (*finish_reason, usage.completion_tokens),
        _ => (FinishReason::Stop, 0),
    };
    let name = match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::ToolCalls => "tool_calls",
    };
    let _ = cached_tokens;
    let record = RequestRecord {
        prompt_tokens,
        completion_tokens: completion,
        ttft_s: first_token.map(|t| (t - settings.arrived).as_secs_f64()),
        e2e_s: settings.arrived.elapsed().as_secs_f64(),
        queue_s: usage.map_or(0.0, |u| u.queue_ms / 1e3),
        prefill_s: usage.map_or(0.0, |u| u.prefill_ms / 1e3),
        decode_s: usage.map_or(0.0, |u| u.decode_ms / 1e3),
    };
    (name, record)
}

/// Adds the cached-token count and the timings to the [`Piece::Done`] of `pieces`.
fn with_timings(mut pieces: Vec<Piece>, cached_tokens: usize, usage: Option<&worker::Usage>) -> Vec<Piece> {
    if let Some(Piece::Done { usage: u, timings, .. }) = pieces.last_mut() {
        *u = u.with_cached(cached_tokens);
        *timings = Timings::new(
            cached_tokens,
            u.prompt_tokens - cached_tokens.min(u.prompt_tokens),
            usage.map_or(0.0, |x| x.prefill_ms),
            u.completion_tokens,
            usage.map_or(0.0, |x| x.decode_ms),
        )
        .with_drafts(usage.map_or(0, |x| x.draft_tokens), usage.map_or(0, |x| x.accepted_draft_tokens));
    }
    pieces
}

/// Sends `pieces` of `choice` in order; false when the reader is gone.
async fn send_all(tx: &mpsc::Sender<(usize, Piece)>, choice: usize, pieces: Vec<Piece>) -> bool {
    for piece in pieces {
        if tx.send((choice, piece)).await.is_err() {
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
    /// Pass text through unparsed (text completions).
    pub raw: bool,
    /// Prompt tokens that stand for images (reported in `usage.prompt_tokens_details.image_tokens`).
    pub image_tokens: usize,
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
            raw: false,
            image_tokens: 0,
        }
    }

    /// Adds the text of one generated token. `Err` holds the last pieces (ending with [`Piece::Done`]) when a
    /// stop string matched: the generation must stop.
    pub fn push_token(&mut self, text: &str) -> Result<Vec<Piece>, Vec<Piece>> {
        self.completion_tokens += 1;
        let (released, matched) = self.stops.push(text);
        let events = self.parse(&released);
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
        let events = self.parse(&released);
        let mut pieces = self.pieces(events);
        pieces.extend(self.end(if matched { FinishReason::Stop } else { reason }));
        pieces
    }

    fn parse(&mut self, text: &str) -> Vec<OutputEvent> {
        if self.raw {
            return if text.is_empty() { Vec::new() } else { vec![OutputEvent::Content(text.to_owned())] };
        }
        self.parser.push(text)
    }

    fn end(&mut self, reason: FinishReason) -> Vec<Piece> {
        let parser = std::mem::replace(&mut self.parser, OutputParser::new(&ParseOptions::default()));
        // Cut off by the token budget, a tool call being written stays open, as written (OpenAI's `length`).
        let events = if reason == FinishReason::Length { parser.finish_truncated() } else { parser.finish() };
        let mut pieces = if self.raw { Vec::new() } else { self.pieces(events) };
        let finish_reason =
            if self.saw_tool_call && reason == FinishReason::Stop { FinishReason::ToolCalls } else { reason };
        pieces.push(Piece::Done {
            finish_reason,
            usage: Usage::new(self.prompt_tokens, self.completion_tokens).with_images(self.image_tokens),
            timings: Timings::default(),
        });
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
                OutputEvent::ToolCallStart { index, id, name } => {
                    self.saw_tool_call = true;
                    Piece::ToolCallStart { index, id, name }
                }
                OutputEvent::ToolCallArguments { index, fragment } => Piece::ToolCallArguments { index, fragment },
            })
            .collect()
    }
}

fn log_usage(usage: &worker::Usage, reason: worker::FinishReason) {
    let decode_tokens = usage.completion_tokens.saturating_sub(1);
    let decode_tok_s = if usage.decode_ms > 0.0 { decode_tokens as f64 / (usage.decode_ms / 1e3) } else { 0.0 };
    let prefill_tok_s = if usage.prefill_ms > 0.0 {
        (usage.prompt_tokens - usage.cached_tokens) as f64 / (usage.prefill_ms / 1e3)
    } else {
        0.0
    };
    tracing::info!(
        ?reason,
        prompt_tokens = usage.prompt_tokens,
        cached_tokens = usage.cached_tokens,
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
        assert!(
            matches!(pieces.last(), Some(Piece::Done { finish_reason: FinishReason::Stop, usage, .. }) if *usage == Usage::new(10, 6))
        );
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

    /// A forced call the budget cuts off is never reported as complete: `length`, and the arguments as far as
    /// they were written (not a made-up `{}`).
    #[test]
    fn a_call_cut_off_by_the_budget_finishes_with_length_and_open_arguments() {
        let tokens = ["ok\n</think>\n\n", "<tool_call>", "\n<function=f>\n<parameter=q>\n", "aaa", "aaa"];
        let pieces = assemble(&tokens, &[], FinishReason::Length);
        let arguments: String = pieces
            .iter()
            .filter_map(
                |p| if let Piece::ToolCallArguments { fragment, .. } = p { Some(fragment.as_str()) } else { None },
            )
            .collect();
        let whole: Vec<&Piece> = pieces.iter().filter(|p| matches!(p, Piece::ToolCall { .. })).collect();
        let arguments = match whole.first() {
            Some(Piece::ToolCall { arguments, .. }) => arguments.clone(),
            _ => arguments,
        };
        assert_eq!(arguments, "{\"q\": \"aaaaaa");
        assert!(matches!(pieces.last(), Some(Piece::Done { finish_reason: FinishReason::Length, .. })));
    }

    #[test]
    fn stop_string_ends_the_turn_and_counts_tokens_up_to_it() {
        let pieces = assemble(&["a\n</think>\n\n", "one ", "two", " three", " four"], &["two"], FinishReason::Length);
        assert_eq!(text_of(&pieces), ("a".into(), "one".into()));
        assert!(
            matches!(pieces.last(), Some(Piece::Done { finish_reason: FinishReason::Stop, usage, .. }) if *usage == Usage::new(10, 3))
        );
    }

    /// The watchdog fails a generation the engine stopped talking about, but never one still waiting in the
    /// queue. Tokio's paused clock makes the waits deterministic.
    #[tokio::test(start_paused = true)]
    async fn watchdog_fails_a_silent_generation_but_not_a_queued_one() {
        let state = crate::state::AppState::new(crate::ServerConfig::default()).unwrap();
        let model = crate::state::load_model(&state).unwrap();
        let settings = DriveSettings {
            watchdog: Duration::from_secs(5),
            metrics: state.metrics.clone(),
            arrived: Instant::now(),
            chat: true,
        };
        let parse = ParseOptions::default();

        // Queued: no event at all for 1000 s is not a failure.
        let (_queued_tx, queued) = mpsc::unbounded_channel();
        let (tx, _rx) = mpsc::channel(16);
        let waited = tokio::time::timeout(
            Duration::from_secs(1000),
            drive(&model, queued, &parse, vec![], (3, 0), &tx, 0, &settings),
        )
        .await;
        assert!(waited.is_err(), "a queued request is not stuck");

        // Started, then silence: failed after the watchdog's time.
        let (events_tx, events) = mpsc::unbounded_channel();
        events_tx.send(GenerationEvent::Started { cached_tokens: 0 }).unwrap();
        let (tx, mut rx) = mpsc::channel(16);
        let t0 = tokio::time::Instant::now();
        assert!(!drive(&model, events, &parse, vec![], (3, 0), &tx, 0, &settings).await);
        assert!(t0.elapsed() >= Duration::from_secs(5));
        assert_eq!(rx.recv().await, Some((0, Piece::Progress)));
        match rx.recv().await {
            Some((0, Piece::Failed(message))) => assert!(message.contains("watchdog"), "{message}"),
            other => panic!("{other:?}"),
        }
        drop(events_tx);
    }

    #[test]
    fn held_text_is_only_a_stop_prefix() {
        let mut m = StopMatcher::new(vec!["<END>".into()]);
        assert_eq!(m.push("hello <E"), ("hello ".into(), false));
        assert_eq!(m.push("ND"), (String::new(), false));
        assert_eq!(m.push("X"), ("<ENDX".into(), false));
    }
}
