//! A chat completion request turned into a [`Generation`]: checks every field (a 400 names the one at fault),
//! renders the conversation with the model's chat template, encodes it, checks it against the context limit, and
//! fills in Qwen's published sampling defaults for the mode (design note `tokenizer-and-template.md` §3).

use std::sync::Arc;

use nebula_engine::sampling::SamplingParams;
use nebula_engine::text::chat_template::{RenderRequest, TemplateError};
use nebula_engine::text::output::ParseOptions;
use nebula_engine::worker::GenerateRequest;
use serde_json::Value;

use crate::error::ApiError;
use crate::generation::Generation;
use crate::openai::{ChatCompletionRequest, MessageContent};
use crate::state::ServedModel;

/// Most stop strings per request (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;

/// Qwen3.8-Flash-Next's recommended sampling with thinking on: T=1.0, top_p=0.95, top_k=20, min_p=0.
pub const THINKING_SAMPLING: SamplingParams =
    SamplingParams { temperature: 1.0, top_k: 20, top_p: 0.95, min_p: 0.0, seed: None };

/// Qwen3.8-Flash-Next's recommended sampling with thinking off: T=0.7, top_p=0.8, top_k=20, min_p=0.
pub const NON_THINKING_SAMPLING: SamplingParams =
    SamplingParams { temperature: 0.7, top_k: 20, top_p: 0.8, min_p: 0.0, seed: None };

/// Reasoning efforts this server takes: `none` turns thinking off, the others are the Qwen3.8 template's.
pub const REASONING_EFFORTS: [&str; 4] = ["none", "low", "medium", "xhigh"];

/// A checked request: what to generate and how to answer.
#[derive(Debug)]
pub struct PreparedChat {
    /// The engine request and how to read its output.
    pub generation: Generation,
    /// Stream the answer.
    pub stream: bool,
    /// Send a final usage chunk (streams only).
    pub include_usage: bool,
    /// Tokens of the rendered prompt.
    pub prompt_tokens: usize,
    /// Whether the model thinks before answering.
    pub thinking: bool,
}

/// Checks `req` against the served `model` and prepares its generation.
///
/// Errors: 404 for another model, 400 for anything invalid, including a prompt that does not fit the context.
pub fn prepare(model: &Arc<ServedModel>, req: ChatCompletionRequest) -> Result<PreparedChat, ApiError> {
    if let Some(requested) = &req.model
        && requested != &model.id
    {
        return Err(ApiError::ModelNotFound { requested: requested.clone(), served: model.id.clone() });
    }
    check_unsupported(&req)?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid("`messages` must contain at least one message.", "messages"));
    }
    check_content(&req)?;
    let max_tokens = match (req.max_completion_tokens, req.max_tokens) {
        (Some(n), _) => Some(positive(n, "max_completion_tokens")?),
        (None, Some(n)) => Some(positive(n, "max_tokens")?),
        (None, None) => None,
    };
    let stop = match req.stop.clone() {
        None => Vec::new(),
        Some(stop) => {
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
            stop
        }
    };

    // Thinking: `reasoning_effort: none` or `enable_thinking: false` turn it off; the template's default is on.
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
    let effort = req.reasoning_effort.clone().or(kwargs_effort);
    if let Some(e) = &effort
        && !REASONING_EFFORTS.contains(&e.as_str())
    {
        return Err(ApiError::invalid(
            format!("`reasoning_effort` must be one of {}; got `{e}`.", REASONING_EFFORTS.join(", ")),
            "reasoning_effort",
        ));
    }
    let enable_thinking = if effort.as_deref() == Some("none") { Some(false) } else { enable_thinking };
    let thinking = enable_thinking.unwrap_or(true);
    let effort = effort.filter(|e| e != "none" && thinking);

    let tools = tools_for_template(&req)?;
    let messages = serde_json::to_value(&req.messages)
        .map_err(|e| ApiError::Internal(format!("re-encoding the messages failed: {e}")))?;
    let render = RenderRequest {
        messages: &messages,
        tools: tools.as_ref(),
        add_generation_prompt: true,
        enable_thinking,
        reasoning_effort: effort.as_deref(),
        extra: kwargs,
    };
    let prompt = model.template.render(&render).map_err(template_error)?;
    let ids = model
        .engine
        .tokenizer()
        .encode(&prompt)
        .map_err(|e| ApiError::Internal(format!("encoding the prompt failed: {e}")))?;
    let limit = model.engine.max_context();
    if ids.len() >= limit {
        return Err(ApiError::invalid_with_code(
            format!(
                "This model's maximum context length is {limit} tokens, but the prompt has {} tokens, which leaves \
                 no room for the completion. Shorten the messages.",
                ids.len()
            ),
            Some("messages".into()),
            "context_length_exceeded",
        ));
    }
    let room = limit - ids.len();
    let sampling = sampling(&req, thinking)?;
    let parse = ParseOptions {
        call_id_prefix: format!("call_{:016x}_", rand::random::<u64>()),
        ..ParseOptions::for_prompt(&prompt).with_tools(tools.as_ref())
    };
    let prompt_tokens = ids.len();
    let mut request = GenerateRequest::new(ids, max_tokens.map_or(room, |n| n.min(room)));
    request.sampling = sampling;
    request.ignore_eos = req.ignore_eos.unwrap_or(false);
    Ok(PreparedChat {
        generation: Generation { request, parse, stop },
        stream: req.stream.unwrap_or(false),
        include_usage: req.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false),
        prompt_tokens,
        thinking,
    })
}

/// Fields this server cannot honour yet are refused, never silently ignored.
fn check_unsupported(req: &ChatCompletionRequest) -> Result<(), ApiError> {
    if let Some(n) = req.n
        && n != 1
    {
        return Err(ApiError::invalid(
            format!("`n` must be 1: this server returns one choice per request (got {n})."),
            "n",
        ));
    }
    if req.logprobs == Some(true) {
        return Err(ApiError::invalid("`logprobs` is not supported yet.", "logprobs"));
    }
    if req.top_logprobs.is_some() {
        return Err(ApiError::invalid("`top_logprobs` is not supported yet.", "top_logprobs"));
    }
    for (name, value) in [("presence_penalty", req.presence_penalty), ("frequency_penalty", req.frequency_penalty)] {
        if let Some(v) = value
            && v != 0.0
        {
            return Err(ApiError::invalid(format!("`{name}` is not supported yet (only 0)."), name));
        }
    }
    if let Some(format) = &req.response_format {
        let kind = format.get("type").and_then(Value::as_str);
        if kind != Some("text") {
            return Err(ApiError::invalid(
                "`response_format` supports only {\"type\": \"text\"} yet (JSON modes come with constrained decoding).",
                "response_format",
            ));
        }
    }
    match &req.tool_choice {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s == "auto" || s == "none" => {}
        Some(_) => {
            return Err(ApiError::invalid("`tool_choice` supports only \"auto\" and \"none\" yet.", "tool_choice"));
        }
    }
    Ok(())
}

/// Content parts must be text: this model reads no images, audio or files.
fn check_content(req: &ChatCompletionRequest) -> Result<(), ApiError> {
    for (i, message) in req.messages.iter().enumerate() {
        let Some(MessageContent::Parts(parts)) = &message.content else { continue };
        for (j, part) in parts.iter().enumerate() {
            let param = format!("messages[{i}].content[{j}]");
            match part.get("type").and_then(Value::as_str) {
                Some("text") => {
                    if !part.get("text").is_some_and(Value::is_string) {
                        return Err(ApiError::invalid("A text content part needs a string `text`.", param));
                    }
                }
                Some(other) => {
                    return Err(ApiError::invalid(
                        format!("Content part type `{other}` is not supported: this model reads text only."),
                        param,
                    ));
                }
                None => return Err(ApiError::invalid("A content part needs a string `type`.", param)),
            }
        }
    }
    Ok(())
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

/// Sampling settings: the request's, else the mode's defaults. Ranges are checked here so the 400 names the field.
fn sampling(req: &ChatCompletionRequest, thinking: bool) -> Result<SamplingParams, ApiError> {
    let defaults = if thinking { THINKING_SAMPLING } else { NON_THINKING_SAMPLING };
    let temperature = match req.temperature {
        None => defaults.temperature,
        Some(t) if t.is_finite() && (0.0..=2.0).contains(&t) => t as f32,
        Some(t) => return Err(ApiError::invalid(format!("`temperature` must be in [0, 2], got {t}."), "temperature")),
    };
    let top_p = match req.top_p {
        None => defaults.top_p,
        Some(p) if p > 0.0 && p <= 1.0 => p as f32,
        Some(p) => return Err(ApiError::invalid(format!("`top_p` must be in (0, 1], got {p}."), "top_p")),
    };
    let top_k = match req.top_k {
        None => defaults.top_k,
        Some(-1 | 0) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => {
            return Err(ApiError::invalid(format!("`top_k` must be -1, 0 (no limit) or positive, got {k}."), "top_k"));
        }
    };
    let min_p = match req.min_p {
        None => defaults.min_p,
        Some(p) if (0.0..=1.0).contains(&p) => p as f32,
        Some(p) => return Err(ApiError::invalid(format!("`min_p` must be in [0, 1], got {p}."), "min_p")),
    };
    // Negative seeds are valid OpenAI seeds; their bits seed the generator.
    let seed = req.seed.map(|s| s as u64);
    Ok(SamplingParams { temperature, top_k, top_p, min_p, seed })
}

fn positive(n: i64, name: &str) -> Result<usize, ApiError> {
    if n < 1 {
        return Err(ApiError::invalid(format!("`{name}` must be at least 1, got {n}."), name));
    }
    Ok(usize::try_from(n).unwrap_or(usize::MAX))
}

/// Template errors come from the conversation (a system message not first, no user query, bad tool arguments).
fn template_error(err: TemplateError) -> ApiError {
    ApiError::invalid(format!("The chat template rejected the conversation: {}", err.message()), "messages")
}
