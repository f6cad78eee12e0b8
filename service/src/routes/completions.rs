//! `POST /v1/completions`: legacy text completion. The prompt is raw text sent to the model as is (no chat
//! template; special tokens written in it are honoured, as in every OpenAI-compatible server), and the output is
//! the raw text (no reasoning or tool-call parsing).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use nebula_engine::text::output::ParseOptions;
use nebula_engine::worker::GenerateRequest;

use crate::chat::{
    SamplingFields, check_completion_room, choices, min_tokens_of_bytes, positive, repetition_guard, sampling,
    stop_strings,
};
use crate::error::{ApiError, ErrorBody};
use crate::extract::OpenAiJson;
use crate::generation::{DriveSettings, Generation, Piece, start};
use crate::openai::{
    Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, FinishReason, PromptInput, Timings, Usage,
};
use crate::state::{AppState, SHUTDOWN_MESSAGE, unix_now};
use crate::stream::{ChunkMeta, completion_sse, push_legacy_logprob};

/// `max_tokens` when a completion request gives none (OpenAI's default).
pub const DEFAULT_COMPLETION_TOKENS: usize = 16;

/// Most alternatives per token in legacy `logprobs`.
pub const MAX_LEGACY_LOGPROBS: i64 = 5;

/// Runs one text completion.
#[utoipa::path(post, path = "/v1/completions", tag = "openai", request_body = CompletionRequest,
    responses(
        (status = 200, description = "The completion, or server-sent events of `Completion` chunks ending with \
            `data: [DONE]` (`stream: true`)",
            content((Completion = "application/json"), (Completion = "text/event-stream"))),
        (status = 400, description = "Invalid request", body = ErrorBody),
        (status = 401, description = "Missing or wrong API key", body = ErrorBody),
        (status = 404, description = "Unknown model", body = ErrorBody),
        (status = 413, description = "Body too large", body = ErrorBody),
        (status = 429, description = "Queue full; see Retry-After", body = ErrorBody),
        (status = 500, description = "Generation failed", body = ErrorBody),
        (status = 503, description = "The model is loading", body = ErrorBody),
        (status = 504, description = "Timed out", body = ErrorBody),
    ))]
pub async fn completions(
    State(state): State<Arc<AppState>>,
    OpenAiJson(req): OpenAiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let model = state.model()?;
    model.check_name(req.model.as_deref())?;
    let one_only = |n: usize| {
        ApiError::invalid(
            format!("`prompt` must be one prompt; got a list of {n} (send one request per prompt)."),
            "prompt",
        )
    };
    // Token-id prompts are checked against the vocabulary and shown (echo) as their decoded text.
    let token_prompt = match &req.prompt {
        PromptInput::Tokens(ids) => Some(ids.clone()),
        PromptInput::TokenLists(lists) if lists.len() == 1 => Some(lists[0].clone()),
        PromptInput::TokenLists(lists) => return Err(one_only(lists.len())),
        _ => None,
    };
    if let Some(ids) = &token_prompt {
        let vocab = model.engine.config().vocab;
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::invalid(
                format!("`prompt` holds token id {bad}, outside the vocabulary of {vocab} tokens."),
                "prompt",
            ));
        }
    }
    let prompt = match &req.prompt {
        PromptInput::One(p) => p.clone(),
        PromptInput::Many(list) if list.len() == 1 => list[0].clone(),
        PromptInput::Many(list) => return Err(one_only(list.len())),
        PromptInput::Tokens(_) | PromptInput::TokenLists(_) => {
            let ids = token_prompt.as_deref().unwrap_or_default();
            model
                .engine
                .tokenizer()
                .decode(ids, false)
                .map_err(|e| ApiError::Internal(format!("decoding the prompt's token ids failed: {e}")))?
        }
    };
    if prompt.is_empty() && token_prompt.as_ref().is_none_or(|t| t.is_empty()) {
        return Err(ApiError::invalid("`prompt` must not be empty.", "prompt"));
    }
    let n = choices(req.n)?;
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("`suffix` is not supported.", "suffix"));
    }
    if let Some(b) = req.best_of
        && b != n as i64
    {
        return Err(ApiError::invalid("`best_of` is not supported (it must equal `n`).", "best_of"));
    }
    let logprobs = match req.logprobs {
        None => None,
        Some(k) if (0..=MAX_LEGACY_LOGPROBS).contains(&k) => Some(k as usize),
        Some(k) => {
            return Err(ApiError::invalid(
                format!("`logprobs` must be between 0 and {MAX_LEGACY_LOGPROBS}, got {k}."),
                "logprobs",
            ));
        }
    };
    let max_tokens = match req.max_tokens {
        None => None,
        Some(n) => Some(positive(n, "max_tokens")?),
    };
    let accuracy_level = match req.accuracy_level {
        None => None,
        Some(level) => Some(nebula_engine::speculative::AccuracyLevel::from_number(level).ok_or_else(|| {
            ApiError::invalid(
                format!("`accuracy_level` must be 1, 2 or 3 (3: exact greedy verification), got {level}."),
                "accuracy_level",
            )
        })?),
    };
    let stop = stop_strings(req.stop.clone())?;
    let fields = SamplingFields {
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        min_p: req.min_p,
        seed: req.seed,
        presence_penalty: req.presence_penalty,
        frequency_penalty: req.frequency_penalty,
        repetition_penalty: req.repetition_penalty,
    };
    // No chat template, no thinking: the non-thinking defaults apply.
    let defaults = &state.config.defaults;
    let params = sampling(&fields, false, defaults)?;
    let limit = model.engine.max_context();
    let ids = match token_prompt {
        Some(ids) => ids,
        None => {
            // A prompt its length alone shows too long is refused before it is encoded; the encoding runs on a
            // blocking thread, where a long prompt cannot hold up other requests.
            let at_least = min_tokens_of_bytes(prompt.len(), model.engine.tokenizer().max_token_bytes());
            if at_least >= limit {
                return Err(ApiError::invalid_with_code(
                    format!(
                        "This model's maximum context length is {limit} tokens, but the prompt has at least \
                         {at_least} tokens ({} bytes), which leaves no room for the completion.",
                        prompt.len()
                    ),
                    Some("prompt".into()),
                    "context_length_exceeded",
                ));
            }
            let tokenizer = model.engine.tokenizer().clone();
            let text = prompt.clone();
            tokio::task::spawn_blocking(move || tokenizer.encode(&text))
                .await
                .map_err(|e| ApiError::Internal(format!("encoding the prompt failed: {e}")))?
                .map_err(|e| ApiError::Internal(format!("encoding the prompt failed: {e}")))?
        }
    };
    if ids.len() >= limit {
        return Err(ApiError::invalid_with_code(
            format!(
                "This model's maximum context length is {limit} tokens, but the prompt has {} tokens, which leaves \
                 no room for the completion.",
                ids.len()
            ),
            Some("prompt".into()),
            "context_length_exceeded",
        ));
    }
    let room = limit - ids.len();
    let ignore_eos = req.ignore_eos.unwrap_or(false);
    // The default budget shrinks to what fits; an explicit one that does not fit is refused.
    let max_tokens = match max_tokens {
        None => DEFAULT_COMPLETION_TOKENS.min(room),
        Some(n) => check_completion_room(n, "max_tokens", ids.len(), limit)?,
    };
    let mut request = GenerateRequest::new(ids, max_tokens);
    request.sampling = params;
    request.ignore_eos = ignore_eos;
    request.logprobs = logprobs;
    request.prefill_chunk = Some(model.max_prefill);
    request.repetition_guard = repetition_guard(defaults, ignore_eos);
    if let Some(level) = accuracy_level {
        request.accuracy_level = level;
    }
    let generation =
        Generation { request, parse: ParseOptions::default(), stop, constraint: None, model: model.clone() };
    let settings = DriveSettings {
        watchdog: Duration::from_secs_f64(state.config.watchdog_s),
        metrics: state.metrics.clone(),
        arrived,
        chat: false,
    };
    let mut pieces = start(generation, n, settings)?;
    let id = format!("cmpl-{:032x}", rand::random::<u128>());
    let created = unix_now();
    if req.stream.unwrap_or(false) {
        let meta = ChunkMeta {
            id,
            created,
            model: model.id.clone(),
            include_usage: req.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false),
            n,
            keepalive: Duration::from_secs_f64(state.config.sse_keepalive_s),
        };
        let echo = req.echo.unwrap_or(false).then(|| prompt.clone());
        return Ok(completion_sse(meta, pieces, echo).into_response());
    }
    let echo = req.echo.unwrap_or(false);
    let mut texts: Vec<String> = vec![if echo { prompt.clone() } else { String::new() }; n];
    let mut lps: Vec<Option<CompletionLogprobs>> = vec![None; n];
    let mut offsets = vec![if echo { prompt.chars().count() } else { 0 }; n];
    let mut ends: Vec<Option<(FinishReason, Usage, Timings)>> = vec![None; n];
    let mut done = 0;
    while done < n {
        let Some((i, piece)) = pieces.recv().await else {
            return Err(ApiError::Internal("the generation ended unexpectedly".into()));
        };
        match piece {
            Piece::Content(t) | Piece::Reasoning(t) => texts[i].push_str(&t),
            Piece::Logprob(lp) => {
                push_legacy_logprob(lps[i].get_or_insert_with(Default::default), &lp, &mut offsets[i])
            }
            Piece::ToolCall { .. }
            | Piece::ToolCallStart { .. }
            | Piece::ToolCallArguments { .. }
            | Piece::Progress => {}
            Piece::Done { finish_reason, usage, timings } => {
                ends[i] = Some((finish_reason, usage, timings));
                done += 1;
            }
            Piece::Failed(message) if message == SHUTDOWN_MESSAGE => return Err(ApiError::ShuttingDown),
            Piece::Failed(message) => return Err(ApiError::Internal(format!("generation failed: {message}"))),
        }
    }
    let mut usage = Usage::new(0, 0);
    let mut timings = Timings::default();
    let mut out = Vec::with_capacity(n);
    for (index, (text, logprobs)) in texts.into_iter().zip(lps).enumerate() {
        let (finish, u, t) = ends[index].unwrap_or((FinishReason::Stop, Usage::new(0, 0), Timings::default()));
        if index == 0 {
            usage = u;
            timings = t;
        } else {
            usage = Usage::new(usage.prompt_tokens, usage.completion_tokens + u.completion_tokens)
                .with_cached(usage.prompt_tokens_details.cached_tokens);
        }
        out.push(CompletionChoice { index, text, finish_reason: Some(finish), logprobs });
    }
    Ok(Json(Completion {
        id,
        object: "text_completion",
        created,
        model: model.id.clone(),
        choices: out,
        usage: Some(usage),
        timings: Some(timings),
    })
    .into_response())
}
