//! A chat completion request turned into a [`Generation`]: checks every field (a 400 names the one at fault),
//! renders the conversation with the model's chat template, encodes it (client text as plain text, see
//! [`crate::prompt`]), checks it against the context limit, fills in the server's sampling defaults for the mode
//! (Qwen's published ones unless configured, design note `tokenizer-and-template.md` §3), and compiles the grammar
//! of `response_format` or a forced `tool_choice`.

use std::sync::Arc;

use nebula_engine::sampling::SamplingParams;
use nebula_engine::speculative::AccuracyLevel;
use nebula_engine::text::chat_template::{RenderRequest, TemplateError};
use nebula_engine::text::output::{ParseOptions, prompt_ends_in_reasoning};
use nebula_engine::worker::{GenerateRequest, RepetitionGuard};
use serde_json::Value;

use crate::config::GenerationDefaults;
use crate::constraint::{response_format_grammar, tool_call_grammar};
use crate::error::ApiError;
use crate::generation::{ConstraintSpec, Generation};
use crate::openai::{ChatCompletionRequest, ChatMessage, MessageContent, Role, StopSequences};
use crate::prompt::{defuse, encode_rendered, pick_marker};
use crate::state::ServedModel;
use crate::vision::ImageRef;

/// Most stop strings per request (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;

/// Most choices per request (`n`).
pub const MAX_CHOICES: i64 = 8;

/// Most alternatives per token (`top_logprobs`, OpenAI's limit).
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// Reasoning efforts this server takes, and what each becomes: `none` turns thinking off; `minimal` and `high`
/// (OpenAI SDK values the Qwen3.8 template does not know) map to its nearest levels, `low` and `xhigh`.
pub const REASONING_EFFORTS: [(&str, Option<&str>); 6] = [
    ("none", None),
    ("minimal", Some("low")),
    ("low", Some("low")),
    ("medium", Some("medium")),
    ("high", Some("xhigh")),
    ("xhigh", Some("xhigh")),
];

/// A checked request: what to generate and how to answer.
#[derive(Debug)]
pub struct PreparedChat {
    /// The engine request and how to read its output.
    pub generation: Generation,
    /// Choices to generate.
    pub n: usize,
    /// Stream the answer.
    pub stream: bool,
    /// Send a final usage chunk (streams only).
    pub include_usage: bool,
    /// Tokens of the rendered prompt.
    pub prompt_tokens: usize,
    /// Whether the model thinks before answering.
    pub thinking: bool,
}

/// Limits that apply to one request: the server's, narrowed by the request's `max_context` / `max_prefill`.
fn request_limits(
    model: &ServedModel,
    max_context: Option<i64>,
    max_prefill: Option<i64>,
) -> Result<(usize, usize), ApiError> {
    let server_context = model.engine.max_context();
    let context = match max_context {
        None => server_context,
        Some(n) if n >= 1 && (n as u64) <= server_context as u64 => n as usize,
        Some(n) => {
            return Err(ApiError::invalid(
                format!("`max_context` must be between 1 and this server's limit of {server_context}, got {n}."),
                "max_context",
            ));
        }
    };
    let server_prefill = model.max_prefill;
    let prefill = match max_prefill {
        None => server_prefill,
        Some(n) if n >= 1 && (n as u64) <= server_prefill as u64 => n as usize,
        Some(n) => {
            return Err(ApiError::invalid(
                format!("`max_prefill` must be between 1 and this server's limit of {server_prefill}, got {n}."),
                "max_prefill",
            ));
        }
    };
    Ok((context, prefill))
}

/// NFC composition shrinks UTF-8 text at most this many times: three Hangul jamo (3 bytes each) compose to one
/// 3-byte syllable; precomposed Latin, Greek and other letters (a 1-2 byte base and 2-byte marks to a 2-4 byte
/// letter) shrink less. Decomposition only grows the text.
pub const NFC_MAX_SHRINK: usize = 3;

/// A lower bound on the tokens of a text of `bytes` UTF-8 bytes, for a tokenizer whose longest token has
/// `max_token_bytes` bytes: NFC leaves at least `bytes / NFC_MAX_SHRINK` bytes, and no token covers more than
/// `max_token_bytes` of them, added tokens included.
pub fn min_tokens_of_bytes(bytes: usize, max_token_bytes: usize) -> usize {
    bytes / (NFC_MAX_SHRINK * max_token_bytes.max(1))
}

/// A lower bound on the tokens of the prompt `messages` render to, from their text alone: the template copies every
/// message's content (trimmed) into the prompt ([`min_tokens_of_bytes`] of that). Cheap: nothing is rendered.
pub fn min_prompt_tokens(messages: &[ChatMessage], max_token_bytes: usize) -> usize {
    let bytes: usize = messages
        .iter()
        .map(|m| match &m.content {
            None => 0,
            Some(MessageContent::Text(t)) => t.trim().len(),
            Some(parts) => parts.text().trim().len(),
        })
        .sum();
    min_tokens_of_bytes(bytes, max_token_bytes)
}

/// Refuses a prompt that leaves no room in `limit`.
fn check_room(prompt_tokens: usize, limit: usize) -> Result<usize, ApiError> {
    if prompt_tokens >= limit {
        return Err(ApiError::invalid_with_code(
            format!(
                "This model's maximum context length is {limit} tokens, but the prompt has {prompt_tokens} tokens, \
                 which leaves no room for the completion. Shorten the messages."
            ),
            Some("messages".into()),
            "context_length_exceeded",
        ));
    }
    Ok(limit - prompt_tokens)
}

/// Refuses a completion budget the context cannot hold (never silently shortened): `n` tokens asked for in field
/// `name` after a prompt of `prompt_tokens`, within `limit`.
pub fn check_completion_room(n: usize, name: &str, prompt_tokens: usize, limit: usize) -> Result<usize, ApiError> {
    if prompt_tokens.saturating_add(n) > limit {
        return Err(ApiError::invalid_with_code(
            format!(
                "This model's maximum context length is {limit} tokens. However, you requested {} tokens \
                 ({prompt_tokens} in the prompt, {n} in `{name}`). Reduce the length of the messages or of `{name}`.",
                prompt_tokens.saturating_add(n)
            ),
            Some(name.to_owned()),
            "context_length_exceeded",
        ));
    }
    Ok(n)
}

/// Checks `req` against the served `model` and prepares its generation. Renders and encodes the prompt, which
/// takes long for a long conversation: call it on a blocking thread ([`prepare_blocking`]) from async code.
///
/// Errors: 404 for another model, 400 for anything invalid, including a prompt that does not fit the context.
pub fn prepare(
    model: &Arc<ServedModel>,
    defaults: &GenerationDefaults,
    req: ChatCompletionRequest,
) -> Result<PreparedChat, ApiError> {
    model.check_name(req.model.as_deref())?;
    let n = choices(req.n)?;
    let logprobs = logprobs_setting(req.logprobs, req.top_logprobs)?;
    if let Some(level) = req.accuracy_level
        && !(1..=3).contains(&level)
    {
        return Err(ApiError::invalid(
            format!("`accuracy_level` must be 1, 2 or 3 (3: exact greedy verification), got {level}."),
            "accuracy_level",
        ));
    }
    if req.messages.is_empty() {
        return Err(ApiError::invalid("`messages` must contain at least one message.", "messages"));
    }
    let images = check_content(&req, model)?;
    let (context_limit, prefill_chunk) = request_limits(model, req.max_context, req.max_prefill)?;
    // A conversation whose text alone is too long for the context is refused before it is rendered and encoded.
    let at_least = min_prompt_tokens(&req.messages, model.engine.tokenizer().max_token_bytes());
    if at_least >= context_limit {
        return Err(ApiError::invalid_with_code(
            format!(
                "This model's maximum context length is {context_limit} tokens, but the messages have at least \
                 {at_least} tokens, which leaves no room for the completion. Shorten the messages."
            ),
            Some("messages".into()),
            "context_length_exceeded",
        ));
    }
    let max_tokens = match (req.max_completion_tokens, req.max_tokens) {
        (Some(n), _) => Some((positive(n, "max_completion_tokens")?, "max_completion_tokens")),
        (None, Some(n)) => Some((positive(n, "max_tokens")?, "max_tokens")),
        (None, None) => None,
    };
    let stop = stop_strings(req.stop.clone())?;

    // Thinking: `reasoning_effort: none` or `enable_thinking: false` turn it off; the server default decides
    // otherwise.
    let mut kwargs = req.chat_template_kwargs.clone().unwrap_or_default();
    let enable_thinking = match kwargs.remove("enable_thinking") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(on)) => Some(on),
        Some(other) => {
            return Err(ApiError::invalid(
                format!("`chat_template_kwargs.enable_thinking` must be a boolean, got {other}."),
                "chat_template_kwargs.enable_thinking",
            ));
        }
    };
    let kwargs_effort = match kwargs.remove("reasoning_effort") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(other) => {
            return Err(ApiError::invalid(
                format!("`chat_template_kwargs.reasoning_effort` must be a string, got {other}."),
                "chat_template_kwargs.reasoning_effort",
            ));
        }
    };
    let requested_effort = req.reasoning_effort.clone().or(kwargs_effort);
    // An unknown effort is `Err` for now: it is an error only when thinking is on (the template ignores the
    // effort when thinking is off).
    let effort: Option<Result<Option<&str>, &str>> = requested_effort
        .as_deref()
        .map(|e| REASONING_EFFORTS.iter().find(|(name, _)| *name == e).map(|(_, mapped)| *mapped).ok_or(e));
    let thinking = match (effort, enable_thinking) {
        (Some(Ok(None)), _) => false,
        (_, Some(on)) => on,
        _ => defaults.enable_thinking,
    };
    let effort = match effort {
        Some(Err(e)) if thinking => {
            let names: Vec<&str> = REASONING_EFFORTS.iter().map(|(n, _)| *n).collect();
            return Err(ApiError::invalid(
                format!("`reasoning_effort` must be one of {}; got `{e}`.", names.join(", ")),
                "reasoning_effort",
            ));
        }
        Some(Err(_)) => None,
        Some(Ok(mapped)) => Some(mapped),
        None => None,
    };
    let effort: Option<&str> = match effort {
        Some(Some(e)) => Some(e),
        _ => (!defaults.reasoning_effort.is_empty()).then_some(defaults.reasoning_effort.as_str()),
    }
    .filter(|_| thinking);

    let tools = tools_for_template(&req)?;
    let forced_tools = forced_tool_choice(&req)?;
    let messages = serde_json::to_value(fold_system_messages(&req.messages))
        .map_err(|e| ApiError::Internal(format!("re-encoding the messages failed: {e}")))?;
    let (prompt, ids) = render_and_encode(model, defaults, &messages, tools.as_ref(), Some(thinking), effort, kwargs)?;
    let (ids, media) = with_images(model, ids, &images, context_limit)?;
    let room = check_room(ids.len(), context_limit)?;

    let sampling = sampling(&req.sampling_fields(), thinking, defaults)?;
    let starts_in_reasoning = prompt_ends_in_reasoning(&prompt);
    let grammar = match (&forced_tools, &req.response_format) {
        (Some(grammar), _) => Some((grammar.clone(), "tool_choice")),
        (None, Some(format)) => response_format_grammar(format)?.map(|g| (g, "response_format")),
        (None, None) => None,
    };
    let constraint = match grammar {
        Some((lark, param)) => {
            // Compile once now so that a bad grammar is a 400 before anything starts.
            let compiler = model.grammar()?;
            compiler.constraint(&lark, starts_in_reasoning, param)?;
            Some(ConstraintSpec { lark, starts_in_reasoning, param })
        }
        None => None,
    };
    let parse = ParseOptions {
        call_id_prefix: format!("call_{:016x}_", rand::random::<u64>()),
        stream_tool_calls: true,
        ..ParseOptions::for_prompt(&prompt).with_tools(tools.as_ref())
    };
    let prompt_tokens = ids.len();
    let ignore_eos = req.ignore_eos.unwrap_or(false);
    let max_tokens = match max_tokens {
        None if defaults.default_max_tokens > 0 => room.min(defaults.default_max_tokens),
        None => room,
        Some((n, name)) => check_completion_room(n, name, ids.len(), context_limit)?,
    };
    let mut request = GenerateRequest::new(ids, max_tokens);
    request.media = media;
    request.sampling = sampling;
    request.ignore_eos = ignore_eos;
    request.logprobs = logprobs;
    request.prefill_chunk = Some(prefill_chunk);
    request.repetition_guard = repetition_guard(defaults, ignore_eos);
    if let Some(level) = req.accuracy_level.and_then(AccuracyLevel::from_number) {
        request.accuracy_level = level;
    }
    Ok(PreparedChat {
        generation: Generation { request, parse, stop, constraint, model: model.clone() },
        n,
        stream: req.stream.unwrap_or(false),
        include_usage: req.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false),
        prompt_tokens,
        thinking,
    })
}

/// [`prepare`] on tokio's blocking pool, so that rendering and encoding a long conversation cannot hold up the
/// runtime's other requests.
///
/// Errors: those of [`prepare`]; 500 if the blocking task fails.
pub async fn prepare_blocking(
    model: Arc<ServedModel>,
    defaults: GenerationDefaults,
    req: ChatCompletionRequest,
) -> Result<PreparedChat, ApiError> {
    tokio::task::spawn_blocking(move || prepare(&model, &defaults, req))
        .await
        .map_err(|e| ApiError::Internal(format!("preparing the request failed: {e}")))?
}

/// The repetition guard for a request (off for `ignore_eos` benchmarks and when configured off).
pub fn repetition_guard(defaults: &GenerationDefaults, ignore_eos: bool) -> Option<RepetitionGuard> {
    (defaults.repetition_window > 0 && !ignore_eos).then_some(RepetitionGuard {
        window: defaults.repetition_window,
        max_period: defaults.repetition_max_period.max(1),
    })
}

/// Renders the conversation and encodes it with client text kept plain (see [`crate::prompt`]).
fn render_and_encode(
    model: &ServedModel,
    defaults: &GenerationDefaults,
    messages: &Value,
    tools: Option<&Value>,
    enable_thinking: Option<bool>,
    effort: Option<&str>,
    extra: serde_json::Map<String, Value>,
) -> Result<(String, Vec<u32>), ApiError> {
    let tokenizer = model.engine.tokenizer();
    let encode_error = |e: String| ApiError::Internal(format!("encoding the prompt failed: {e}"));
    if defaults.allow_special_tokens_in_content {
        let render = RenderRequest {
            messages,
            tools,
            add_generation_prompt: true,
            enable_thinking,
            reasoning_effort: effort,
            extra,
        };
        let prompt = model.template.render(&render).map_err(template_error)?;
        let ids = tokenizer.encode(&prompt).map_err(|e| encode_error(e.to_string()))?;
        return Ok((prompt, ids));
    }
    let marker = pick_marker(&[messages, tools.unwrap_or(&Value::Null)]);
    let safe_messages = defuse(messages, &model.specials, marker);
    let safe_tools = tools.map(|t| defuse(t, &model.specials, marker));
    let render = RenderRequest {
        messages: &safe_messages,
        tools: safe_tools.as_ref(),
        add_generation_prompt: true,
        enable_thinking,
        reasoning_effort: effort,
        extra,
    };
    let rendered = model.template.render(&render).map_err(template_error)?;
    let ids = encode_rendered(tokenizer, &rendered, &model.specials, marker).map_err(encode_error)?;
    Ok((rendered.replace(marker, ""), ids))
}

/// `n`, checked.
pub fn choices(n: Option<i64>) -> Result<usize, ApiError> {
    match n {
        None => Ok(1),
        Some(n) if (1..=MAX_CHOICES).contains(&n) => Ok(n as usize),
        Some(n) => Err(ApiError::invalid(format!("`n` must be between 1 and {MAX_CHOICES}, got {n}."), "n")),
    }
}

/// `logprobs` / `top_logprobs` as the engine's setting.
fn logprobs_setting(logprobs: Option<bool>, top: Option<i64>) -> Result<Option<usize>, ApiError> {
    match (logprobs.unwrap_or(false), top) {
        (_, Some(k)) if !(0..=MAX_TOP_LOGPROBS).contains(&k) => Err(ApiError::invalid(
            format!("`top_logprobs` must be between 0 and {MAX_TOP_LOGPROBS}, got {k}."),
            "top_logprobs",
        )),
        (false, Some(k)) if k > 0 => Err(ApiError::invalid("`top_logprobs` needs `logprobs: true`.", "top_logprobs")),
        (true, k) => Ok(Some(k.unwrap_or(0) as usize)),
        (false, _) => Ok(None),
    }
}

/// `stop`, checked.
pub fn stop_strings(stop: Option<StopSequences>) -> Result<Vec<String>, ApiError> {
    let Some(stop) = stop else { return Ok(Vec::new()) };
    let stop = stop.into_vec();
    if stop.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            format!("`stop` takes at most {MAX_STOP_STRINGS} strings, got {}.", stop.len()),
            "stop",
        ));
    }
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid("`stop` strings must not be empty.", "stop"));
    }
    Ok(stop)
}

/// The grammar that forces a tool call, for `tool_choice: "required"` or a named function; `None` otherwise.
fn forced_tool_choice(req: &ChatCompletionRequest) -> Result<Option<String>, ApiError> {
    let tools = req.tools.as_deref().unwrap_or_default();
    let parallel = req.parallel_tool_calls.unwrap_or(true);
    match &req.tool_choice {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s == "auto" || s == "none" => Ok(None),
        Some(Value::String(s)) if s == "required" => tool_call_grammar(tools, None, parallel).map(Some),
        Some(Value::Object(choice)) if choice.get("type").and_then(Value::as_str) == Some("function") => {
            let name = choice
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::invalid("`tool_choice.function.name` must be a string.", "tool_choice"))?;
            tool_call_grammar(tools, Some(name), false).map(Some)
        }
        Some(_) => Err(ApiError::invalid(
            "`tool_choice` must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}.",
            "tool_choice",
        )),
    }
}

/// The system messages of a conversation as the Qwen3.8 template can render them: the template takes one system
/// message, first, and refuses any other (OpenAI clients send a second one, or one later in the conversation, as
/// pydantic-ai does on a retry). So every system message's text (trimmed, as the template trims it) is folded,
/// in order and separated by a blank line, into one system message at the start; the other messages keep their
/// order. A conversation with at most one system message, first, comes back unchanged.
pub fn fold_system_messages(messages: &[ChatMessage]) -> std::borrow::Cow<'_, [ChatMessage]> {
    let systems = messages.iter().filter(|m| m.role == Role::System).count();
    if systems == 0 || (systems == 1 && messages[0].role == Role::System) {
        return std::borrow::Cow::Borrowed(messages);
    }
    let text: Vec<String> = messages
        .iter()
        .filter(|m| m.role == Role::System)
        .filter_map(|m| m.content.as_ref().map(|c| c.text().trim().to_owned()))
        .filter(|t| !t.is_empty())
        .collect();
    let first = messages.iter().find(|m| m.role == Role::System).cloned().map(|mut m| {
        m.content = Some(MessageContent::Text(text.join("\n\n")));
        m
    });
    std::borrow::Cow::Owned(
        first.into_iter().chain(messages.iter().filter(|m| m.role != Role::System).cloned()).collect(),
    )
}

/// Fields OpenAI requires per role: a `tool` message answers a `tool_call_id`, a user message has `content`.
fn check_roles(req: &ChatCompletionRequest) -> Result<(), ApiError> {
    for (i, message) in req.messages.iter().enumerate() {
        let missing = match message.role {
            Role::Tool if message.tool_call_id.is_none() => Some("tool_call_id"),
            Role::User if message.content.is_none() => Some("content"),
            _ => None,
        };
        if let Some(field) = missing {
            return Err(ApiError::invalid_with_code(
                format!("Missing required parameter: 'messages[{i}].{field}'."),
                Some(format!("messages[{i}].{field}")),
                "missing_required_parameter",
            ));
        }
    }
    Ok(())
}

/// Content parts must be text, or images (`image_url`) when a vision tower is loaded and the backend takes
/// them. Returns the images in the order the template renders them (messages, then parts).
fn check_content(req: &ChatCompletionRequest, model: &ServedModel) -> Result<Vec<ImageRef>, ApiError> {
    check_roles(req)?;
    let mut images = Vec::new();
    for (i, message) in req.messages.iter().enumerate() {
        let Some(MessageContent::Parts(parts)) = &message.content else { continue };
        for (j, part) in parts.iter().enumerate() {
            let param = part
                .get(crate::vision::PARAM_KEY)
                .and_then(Value::as_str)
                .map_or_else(|| format!("messages[{i}].content[{j}]"), str::to_owned);
            match part.get("type").and_then(Value::as_str) {
                Some("text") => {
                    if !part.get("text").is_some_and(Value::is_string) {
                        return Err(ApiError::invalid("A text content part needs a string `text`.", param));
                    }
                }
                Some("image_url") => {
                    if model.vision.is_none() {
                        return Err(ApiError::invalid(
                            "Image input needs a vision tower, and none is loaded: start the server with --mmproj                              FILE (the model's mmproj GGUF).",
                            param,
                        ));
                    }
                    if !model.engine.accepts_media() {
                        return Err(ApiError::invalid("This server's backend takes no image input.", param));
                    }
                    if message.role == Role::System {
                        return Err(ApiError::invalid("A system message cannot contain images.", param));
                    }
                    let url = crate::vision::part_url(part, &param)?;
                    images.push(ImageRef { param, url });
                }
                Some(other) => {
                    let what = if model.vision.is_some() {
                        "text and image_url parts are read"
                    } else {
                        "this model reads text only"
                    };
                    return Err(ApiError::invalid(
                        format!("Content part type `{other}` is not supported: {what}."),
                        param,
                    ));
                }
                None => return Err(ApiError::invalid("A content part needs a string `type`.", param)),
            }
        }
    }
    Ok(images)
}

/// The prompt with its images: each image read, decoded and run through the tower, its one `<|image_pad|>`
/// expanded to its feature count (`crate::vision`). A prompt without images comes back as it is.
///
/// Errors: 400 naming the image's part for an image that cannot be used, or when the images leave no room in
/// the context.
fn with_images(
    model: &ServedModel,
    ids: Vec<u32>,
    images: &[ImageRef],
    context_limit: usize,
) -> Result<(Vec<u32>, Option<Arc<nebula_engine::vision::MediaPrompt>>), ApiError> {
    let Some(tower) = model.vision.as_ref().filter(|_| !images.is_empty()) else { return Ok((ids, None)) };
    let pad = model
        .engine
        .tokenizer()
        .token_to_id("<|image_pad|>")
        .ok_or_else(|| ApiError::Internal("the tokenizer has no <|image_pad|> token".into()))?;
    let encoded = crate::vision::encode_images(tower, model.vision_gpu.as_deref(), images, &model.vision_config)?;
    let image_tokens: usize = encoded.iter().map(|e| e.rows * e.cols).sum();
    let total = ids.len() - images.len() + image_tokens;
    if total >= context_limit {
        return Err(ApiError::invalid_with_code(
            format!(
                "This model's maximum context length is {context_limit} tokens, but with its {} images ({image_tokens} \
                 tokens) the prompt has {total} tokens, which leaves no room for the completion. Send fewer or \
                 smaller images.",
                images.len()
            ),
            Some(images[0].param.clone()),
            "context_length_exceeded",
        ));
    }
    let cfg = model.engine.config();
    let (ids, media) = crate::vision::expand_prompt(&ids, pad, &encoded, images, cfg.vocab, cfg.hidden)?;
    Ok((ids, Some(media)))
}

/// The tools to render, checked for the shape the template and the output parser need; `None` for no tools or
/// `tool_choice: "none"`.
fn tools_for_template(req: &ChatCompletionRequest) -> Result<Option<Value>, ApiError> {
    let Some(tools) = &req.tools else { return Ok(None) };
    for (i, tool) in tools.iter().enumerate() {
        let param = format!("tools[{i}]");
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::invalid("Each tool needs `\"type\": \"function\"`.", param));
        }
        let name = tool.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
        if name.is_none_or(str::is_empty) {
            return Err(ApiError::invalid("Each tool needs a `function` object with a non-empty `name`.", param));
        }
    }
    let none = matches!(&req.tool_choice, Some(Value::String(s)) if s == "none");
    Ok((!tools.is_empty() && !none).then(|| Value::Array(tools.iter().cloned().map(Value::Object).collect())))
}

/// The sampling fields shared by chat and text completions.
#[derive(Debug, Clone, Copy, Default)]
pub struct SamplingFields {
    /// `temperature`.
    pub temperature: Option<f64>,
    /// `top_p`.
    pub top_p: Option<f64>,
    /// `top_k`.
    pub top_k: Option<i64>,
    /// `min_p`.
    pub min_p: Option<f64>,
    /// `seed`.
    pub seed: Option<i64>,
    /// `presence_penalty`.
    pub presence_penalty: Option<f64>,
    /// `frequency_penalty`.
    pub frequency_penalty: Option<f64>,
    /// `repetition_penalty`.
    pub repetition_penalty: Option<f64>,
}

impl ChatCompletionRequest {
    /// The sampling fields of this request.
    pub fn sampling_fields(&self) -> SamplingFields {
        SamplingFields {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            seed: self.seed,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty,
        }
    }
}

/// Sampling settings: the request's, else the server's defaults for the mode. Ranges are checked here so the
/// 400 names the field.
pub fn sampling(
    req: &SamplingFields,
    thinking: bool,
    defaults: &GenerationDefaults,
) -> Result<SamplingParams, ApiError> {
    let d = if thinking { defaults.thinking } else { defaults.non_thinking };
    let temperature = match req.temperature {
        None => d.temperature,
        Some(t) if t.is_finite() && (0.0..=2.0).contains(&t) => t as f32,
        Some(t) => return Err(ApiError::invalid(format!("`temperature` must be in [0, 2], got {t}."), "temperature")),
    };
    let top_p = match req.top_p {
        None => d.top_p,
        Some(p) if p > 0.0 && p <= 1.0 => p as f32,
        Some(p) => return Err(ApiError::invalid(format!("`top_p` must be in (0, 1], got {p}."), "top_p")),
    };
    let top_k = match req.top_k {
        None => d.top_k,
        Some(-1 | 0) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => {
            return Err(ApiError::invalid(format!("`top_k` must be -1, 0 (no limit) or positive, got {k}."), "top_k"));
        }
    };
    let min_p = match req.min_p {
        None => d.min_p,
        Some(p) if (0.0..=1.0).contains(&p) => p as f32,
        Some(p) => return Err(ApiError::invalid(format!("`min_p` must be in [0, 1], got {p}."), "min_p")),
    };
    let penalty = |value: Option<f64>, default: f32, name: &str| match value {
        None => Ok(default),
        Some(v) if (-2.0..=2.0).contains(&v) => Ok(v as f32),
        Some(v) => Err(ApiError::invalid(format!("`{name}` must be in [-2, 2], got {v}."), name)),
    };
    let presence_penalty = penalty(req.presence_penalty, d.presence_penalty, "presence_penalty")?;
    let frequency_penalty = penalty(req.frequency_penalty, d.frequency_penalty, "frequency_penalty")?;
    let repetition_penalty = match req.repetition_penalty {
        None => d.repetition_penalty,
        Some(v) if v.is_finite() && v > 0.0 && v <= 10.0 => v as f32,
        Some(v) => {
            return Err(ApiError::invalid(
                format!("`repetition_penalty` must be in (0, 10], got {v}."),
                "repetition_penalty",
            ));
        }
    };
    // Negative seeds are valid OpenAI seeds; their bits seed the generator.
    let seed = req.seed.map(|s| s as u64);
    Ok(SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        seed,
        presence_penalty,
        frequency_penalty,
        repetition_penalty,
    })
}

/// A count of at least 1; the 400 names `name`.
pub fn positive(n: i64, name: &str) -> Result<usize, ApiError> {
    if n < 1 {
        return Err(ApiError::invalid(format!("`{name}` must be at least 1, got {n}."), name));
    }
    Ok(usize::try_from(n).unwrap_or(usize::MAX))
}

/// Template errors come from the conversation (a system message not first, no user query, bad tool arguments).
fn template_error(err: TemplateError) -> ApiError {
    ApiError::invalid(format!("The chat template rejected the conversation: {}", err.message()), "messages")
}
