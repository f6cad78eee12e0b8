//! The OpenAI Responses API (`POST /v1/responses`) wire types, and its request turned into a chat completion
//! request (the same generation path as chat completions, see [`crate::conversation`]).
//!
//! Stateless: nothing is stored. `store: true` is accepted (the response says `store: false`);
//! `previous_response_id`, `conversation`, `background` and stored `prompt` templates are refused with a 400 (the
//! client replays the history in `input`, as the Codex CLI does). Unknown top-level fields are refused, as
//! OpenAI does.
//!
//! Tools: `function` tools as they are; a `namespace` tool's functions are offered to the model as
//! `{namespace}__{name}` (no doubled `__` when the namespace ends with one) and come back as `function_call`
//! items with `namespace` and the function's own `name`, as the openai SDK's `ResponseFunctionToolCall` carries
//! them. Hosted tools the server cannot run (`web_search`, `file_search`, `computer_use_preview`,
//! `code_interpreter`, `image_generation`, `mcp`, `local_shell`, `custom`, …) are left out of the prompt with a
//! warning in the log.
//!
//! Reasoning comes back as a `reasoning` item: as `summary` text when `reasoning.summary` is set (the summary is
//! the thinking itself: there is no separate summarizer), else as `content` (`reasoning_text`). With
//! `include: ["reasoning.encrypted_content"]` the item also carries the thinking sealed by [`crate::seal`]; a
//! replayed reasoning item gives the model its text (from `content`, else the sealed blob, else `summary`).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use utoipa::ToSchema;

use crate::conversation::{Conversation, chat_tool, text_of_parts};
use crate::error::ApiError;
use crate::openai::ChatCompletionRequest;
use crate::seal::ReasoningSeal;

/// Body of `POST /v1/responses`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"model": "nebula-demo", "input": "Hello!", "max_output_tokens": 64}))]
pub struct CreateResponseRequest {
    /// Model id: the served one, an alias, or any name with `serve_any_model` (absent: the served one).
    pub model: Option<String>,
    /// The conversation: a user text, or a list of items (`message` with `input_text`/`output_text` parts and
    /// roles user/assistant/system/developer, `function_call`, `function_call_output`, `reasoning`).
    #[schema(value_type = Option<Object>)]
    pub input: Option<Value>,
    /// A system text placed before everything else.
    pub instructions: Option<String>,
    /// `function` and `namespace` tools; hosted tool types are left out (see the module docs).
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Vec<Value>>,
    /// `"auto"`, `"none"`, `"required"` or `{"type": "function", "name": ...}` (forced by constrained decoding).
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", ...}, "verbosity": ...}`.
    pub text: Option<TextConfig>,
    /// `{"effort": ..., "summary": ...}`.
    pub reasoning: Option<ReasoningConfig>,
    /// Most tokens to generate, reasoning included; above what the context leaves: 400.
    pub max_output_tokens: Option<i64>,
    /// Most tool calls in the response (accepted; the model's calls are not counted against it).
    pub max_tool_calls: Option<i64>,
    /// Softmax temperature in [0, 2].
    pub temperature: Option<f64>,
    /// Nucleus sampling mass in (0, 1].
    pub top_p: Option<f64>,
    /// Accepted, ignored (no log-probabilities in responses).
    pub top_logprobs: Option<i64>,
    /// Several tool calls in one turn (default true).
    pub parallel_tool_calls: Option<bool>,
    /// Accepted; nothing is stored.
    pub store: Option<bool>,
    /// Echoed back.
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Map<String, Value>>,
    /// Accepted (the prefix cache needs no key).
    pub prompt_cache_key: Option<String>,
    /// Accepted, ignored.
    pub prompt_cache_retention: Option<String>,
    /// Accepted, ignored (the Codex CLI's client facts).
    #[schema(value_type = Option<Object>)]
    pub client_metadata: Option<Value>,
    /// `reasoning.encrypted_content` returns sealed reasoning; other values are accepted and ignored.
    pub include: Option<Vec<String>>,
    /// End-user id (accepted).
    pub user: Option<String>,
    /// Accepted, ignored.
    pub safety_identifier: Option<String>,
    /// `auto` or `disabled`: accepted; a prompt over the context is always a 400, never cut.
    pub truncation: Option<String>,
    /// Accepted, ignored.
    pub service_tier: Option<String>,
    /// Stream the response as server-sent events.
    pub stream: Option<bool>,
    /// Accepted, ignored.
    #[schema(value_type = Option<Object>)]
    pub stream_options: Option<Value>,
    /// Refused: nothing is stored (replay the history in `input`).
    pub previous_response_id: Option<String>,
    /// Refused: nothing is stored.
    #[schema(value_type = Option<Object>)]
    pub conversation: Option<Value>,
    /// Refused when true: responses are not run in the background.
    pub background: Option<bool>,
    /// Refused: no stored prompt templates.
    #[schema(value_type = Option<Object>)]
    pub prompt: Option<Value>,
}

/// `text` of a request.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct TextConfig {
    /// `{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", "name", "schema", "strict"}`.
    #[schema(value_type = Option<Object>)]
    pub format: Option<Value>,
    /// Accepted, ignored.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verbosity: Option<String>,
}

/// `reasoning` of a request.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct ReasoningConfig {
    /// `none` (thinking off), `minimal`, `low`, `medium`, `high`, `xhigh`; absent: the server default.
    pub effort: Option<String>,
    /// `auto`, `concise` or `detailed`: return the thinking as the reasoning item's summary.
    pub summary: Option<String>,
    /// Older name of `summary`.
    #[serde(default, skip_serializing)]
    pub generate_summary: Option<String>,
}

/// Tool types a client may send that this server cannot run (left out of the prompt, with a warning).
pub const HOSTED_TOOL_TYPES: [&str; 14] = [
    "web_search",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "file_search",
    "computer_use_preview",
    "computer",
    "code_interpreter",
    "image_generation",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
    "custom",
    "tool_search",
];

/// What the handler needs besides the chat request.
#[derive(Debug, Default)]
pub struct ResponsesPlan {
    /// Model-facing function name -> (namespace, function name) for namespaced functions.
    pub namespaced: HashMap<String, (String, String)>,
    /// The tools as the response echoes them (functions and namespaces; hosted ones left out).
    pub tools: Vec<Value>,
    /// Return the reasoning as `summary` (else as `content`).
    pub summary: bool,
    /// Add `encrypted_content` to reasoning items.
    pub encrypted: bool,
}

/// The name the model sees for function `name` of `namespace`.
pub fn namespaced_name(namespace: &str, name: &str) -> String {
    if namespace.ends_with("__") { format!("{namespace}{name}") } else { format!("{namespace}__{name}") }
}

fn str_field<'a>(item: &'a Value, key: &str) -> Option<&'a str> {
    item.get(key).and_then(Value::as_str)
}

fn need_str(item: &Value, key: &str, param: &str) -> Result<String, ApiError> {
    str_field(item, key)
        .map(str::to_owned)
        .ok_or_else(|| ApiError::invalid(format!("`{param}.{key}` must be a string."), format!("{param}.{key}")))
}

/// The tools for the template, and the plan's tool tables.
fn convert_tools(req: &CreateResponseRequest, plan: &mut ResponsesPlan) -> Result<Vec<Map<String, Value>>, ApiError> {
    let mut out = Vec::new();
    for (i, tool) in req.tools.iter().flatten().enumerate() {
        let param = format!("tools[{i}]");
        let kind = str_field(tool, "type")
            .ok_or_else(|| ApiError::invalid("Each tool needs a string `type`.", format!("{param}.type")))?;
        match kind {
            "function" => {
                let name = need_str(tool, "name", &param)?;
                out.push(chat_tool(&name, tool.get("description"), tool.get("parameters")));
                plan.tools.push(tool.clone());
            }
            "namespace" => {
                let namespace = need_str(tool, "name", &param)?;
                let Some(functions) = tool.get("tools").and_then(Value::as_array) else {
                    return Err(ApiError::invalid("A namespace tool needs a `tools` list.", format!("{param}.tools")));
                };
                for (j, f) in functions.iter().enumerate() {
                    let fparam = format!("{param}.tools[{j}]");
                    match str_field(f, "type") {
                        Some("function") => {
                            let name = need_str(f, "name", &fparam)?;
                            let shown = namespaced_name(&namespace, &name);
                            out.push(chat_tool(&shown, f.get("description"), f.get("parameters")));
                            plan.namespaced.insert(shown, (namespace.clone(), name));
                        }
                        other => tracing::warn!(
                            tool = ?other, namespace = %namespace,
                            "a namespaced tool of this type cannot be offered to the model; left out"
                        ),
                    }
                }
                plan.tools.push(tool.clone());
            }
            other if HOSTED_TOOL_TYPES.contains(&other) || other.starts_with("web_search") => {
                tracing::warn!(tool = other, "a hosted tool this server cannot run; left out of the prompt");
            }
            other => {
                tracing::warn!(tool = other, "an unknown tool type; left out of the prompt");
            }
        }
    }
    Ok(out)
}

/// `tool_choice` in the chat completion shape.
fn convert_tool_choice(choice: &Option<Value>, plan: &ResponsesPlan) -> Result<Option<Value>, ApiError> {
    match choice {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if ["auto", "none", "required"].contains(&s.as_str()) => Ok(Some(json!(s))),
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::invalid("`tool_choice.name` must be a string.", "tool_choice.name"))?;
            let shown = match o.get("namespace").and_then(Value::as_str) {
                Some(ns) => namespaced_name(ns, name),
                None => name.to_owned(),
            };
            let _ = plan;
            Ok(Some(json!({"type": "function", "function": {"name": shown}})))
        }
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("allowed_tools") => {
            // The allowed subset is not enforced; its mode is.
            Ok(o.get("mode").cloned())
        }
        Some(_) => Err(ApiError::invalid(
            "`tool_choice` must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\": ...}.",
            "tool_choice",
        )),
    }
}

/// `text.format` as a chat `response_format`.
fn convert_format(text: &Option<TextConfig>) -> Result<Option<Value>, ApiError> {
    let Some(format) = text.as_ref().and_then(|t| t.format.as_ref()) else { return Ok(None) };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let schema = format
                .get("schema")
                .cloned()
                .ok_or_else(|| ApiError::invalid("A json_schema format needs a `schema`.", "text.format.schema"))?;
            let name = format.get("name").cloned().unwrap_or(json!("response"));
            let mut inner = json!({"name": name, "schema": schema});
            if let Some(strict) = format.get("strict") {
                inner["strict"] = strict.clone();
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": inner})))
        }
        _ => Err(ApiError::invalid(
            "`text.format.type` must be \"text\", \"json_object\" or \"json_schema\".",
            "text.format.type",
        )),
    }
}

/// The text of a replayed reasoning item: its `content`, else its sealed blob, else its `summary`.
fn reasoning_text(item: &Value, seal: &ReasoningSeal) -> String {
    let joined = |key: &str| -> String {
        item.get(key)
            .and_then(Value::as_array)
            .map(|parts| parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect::<Vec<_>>())
            .unwrap_or_default()
            .join("\n\n")
    };
    let content = joined("content");
    if !content.is_empty() {
        return content;
    }
    if let Some(blob) = item.get("encrypted_content").and_then(Value::as_str) {
        match seal.open(blob) {
            Ok(text) => return text,
            Err(why) => {
                let id = item.get("id").and_then(Value::as_str).unwrap_or("");
                tracing::warn!(id, "a replayed reasoning item's encrypted_content does not open ({why}); ignored");
            }
        }
    }
    joined("summary")
}

/// Checks `req` and turns it into a chat completion request (model left out: the handler checked it) and the
/// plan for the answer.
///
/// Errors: 400 naming the field for anything invalid or refused (see the module docs).
pub fn to_chat_request(
    req: &CreateResponseRequest,
    seal: &ReasoningSeal,
) -> Result<(ChatCompletionRequest, ResponsesPlan), ApiError> {
    if req.previous_response_id.is_some() {
        return Err(ApiError::invalid(
            "`previous_response_id` is not supported: this server stores no responses. Send the whole \
             conversation in `input` (with `store: false`).",
            "previous_response_id",
        ));
    }
    if req.conversation.is_some() {
        return Err(ApiError::invalid("`conversation` is not supported: this server stores nothing.", "conversation"));
    }
    if req.background == Some(true) {
        return Err(ApiError::invalid("`background: true` is not supported.", "background"));
    }
    if req.prompt.is_some() {
        return Err(ApiError::invalid("`prompt` (stored prompt templates) is not supported.", "prompt"));
    }
    let mut plan = ResponsesPlan::default();
    let summary = req.reasoning.as_ref().and_then(|r| r.summary.clone().or(r.generate_summary.clone()));
    plan.summary = summary.is_some_and(|s| s != "none");
    plan.encrypted = req.include.iter().flatten().any(|i| i == "reasoning.encrypted_content");
    let tools = convert_tools(req, &mut plan)?;

    let mut conv = Conversation::default();
    if let Some(instructions) = &req.instructions {
        conv.system(instructions.clone());
    }
    match &req.input {
        None | Some(Value::Null) => return Err(ApiError::invalid("`input` is required.", "input")),
        Some(Value::String(text)) => conv.user(text.clone()),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                add_item(&mut conv, item, &format!("input[{i}]"), seal)?;
            }
        }
        Some(_) => return Err(ApiError::invalid("`input` must be a string or a list of items.", "input")),
    }
    let messages = conv.into_messages();
    if messages.is_empty() {
        return Err(ApiError::invalid("`input` must contain at least one item.", "input"));
    }
    let effort = req.reasoning.as_ref().and_then(|r| r.effort.clone());
    let chat = ChatCompletionRequest {
        messages,
        temperature: req.temperature,
        top_p: req.top_p,
        tools: (!tools.is_empty()).then_some(tools),
        tool_choice: convert_tool_choice(&req.tool_choice, &plan)?,
        parallel_tool_calls: req.parallel_tool_calls,
        reasoning_effort: effort,
        response_format: convert_format(&req.text)?,
        user: req.user.clone(),
        ..ChatCompletionRequest::default()
    };
    Ok((chat, plan))
}

/// A user message with `input_image` parts: text parts and images in order, as chat `text` / `image_url` parts.
///
/// Errors: 400 naming the part: an image by `file_id` (this server keeps no files), no `image_url`, a part of
/// another type.
fn user_parts_with_images(conv: &mut Conversation, parts: &[Value], param: &str) -> Result<(), ApiError> {
    let mut out = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let pparam = format!("{param}[{j}]");
        match part.get("type").and_then(Value::as_str) {
            Some("input_text" | "text") => match part.get("text").and_then(Value::as_str) {
                Some(t) => out.push(crate::conversation::text_part(t)),
                None => {
                    return Err(ApiError::invalid(
                        "An `input_text` part needs a string `text`.",
                        format!("{pparam}.text"),
                    ));
                }
            },
            Some("input_image") => match part.get("image_url").and_then(Value::as_str) {
                Some(url) if !url.is_empty() => out.push(crate::conversation::image_part(url.to_owned(), &pparam)),
                _ if part.get("file_id").is_some() => {
                    return Err(ApiError::invalid(
                        "An `input_image` by `file_id` cannot be read: this server keeps no files. Send `image_url` \
                         as a data: URL.",
                        format!("{pparam}.file_id"),
                    ));
                }
                _ => return Err(ApiError::invalid("An `input_image` part needs `image_url`, a data: URL.", pparam)),
            },
            Some(k) => {
                return Err(ApiError::invalid(
                    format!("Content of type `{k}` is not supported in a user message with images."),
                    format!("{pparam}.type"),
                ));
            }
            None => return Err(ApiError::invalid("A content part needs a string `type`.", pparam)),
        }
    }
    conv.user_parts(out);
    Ok(())
}

/// Adds one input item to the conversation.
fn add_item(conv: &mut Conversation, item: &Value, param: &str, seal: &ReasoningSeal) -> Result<(), ApiError> {
    if !item.is_object() {
        return Err(ApiError::invalid("Each input item must be an object.", param));
    }
    let kind = str_field(item, "type").unwrap_or(if item.get("role").is_some() { "message" } else { "" });
    match kind {
        "message" => {
            let role = need_str(item, "role", param)?;
            let content = item
                .get("content")
                .ok_or_else(|| ApiError::invalid("A message item needs `content`.", format!("{param}.content")))?;
            if let Some(parts) = content.as_array()
                && role == "user"
                && parts.iter().any(|p| p.get("type").and_then(Value::as_str) == Some("input_image"))
            {
                return user_parts_with_images(conv, parts, &format!("{param}.content"));
            }
            let text = text_of_parts(
                content,
                &["input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text"],
                &format!("{param}.content"),
            )
            .or_else(|e| match content.as_array() {
                // A refusal part carries `refusal`, not `text`.
                Some(parts) if parts.iter().all(|p| p.get("refusal").is_some()) => {
                    Ok(parts.iter().filter_map(|p| p.get("refusal").and_then(Value::as_str)).collect())
                }
                _ => Err(e),
            })?;
            match role.as_str() {
                "system" | "developer" => conv.system(text),
                "user" => conv.user(text),
                "assistant" => conv.assistant_text(text),
                other => {
                    return Err(ApiError::invalid(
                        format!("Unknown role `{other}`: expected user, assistant, system or developer."),
                        format!("{param}.role"),
                    ));
                }
            }
        }
        "function_call" => {
            let name = need_str(item, "name", param)?;
            let name = match str_field(item, "namespace") {
                Some(ns) => namespaced_name(ns, &name),
                None => name,
            };
            let call_id = need_str(item, "call_id", param)?;
            let arguments = need_str(item, "arguments", param)?;
            conv.assistant_tool_call(call_id, name, Value::String(arguments));
        }
        "function_call_output" => {
            let call_id = need_str(item, "call_id", param)?;
            let output = item.get("output").ok_or_else(|| {
                ApiError::invalid("A function_call_output item needs `output`.", format!("{param}.output"))
            })?;
            let text = text_of_parts(output, &["input_text", "output_text", "text"], &format!("{param}.output"))?;
            conv.tool_result(call_id, text);
        }
        "reasoning" => {
            let text = reasoning_text(item, seal);
            if !text.is_empty() {
                conv.assistant_reasoning(text);
            }
        }
        "item_reference" => {
            return Err(ApiError::invalid(
                "`item_reference` items are not supported: this server stores nothing. Send the item itself.",
                format!("{param}.type"),
            ));
        }
        "" => return Err(ApiError::invalid("Each input item needs a `type` or a `role`.", param)),
        other => {
            tracing::warn!(item = other, "an input item of a type this server does not use; left out of the prompt");
        }
    }
    Ok(())
}

/// A response object (`"object": "response"`), as returned and as carried by the stream's lifecycle events.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ResponseObject {
    /// `resp_…`.
    pub id: String,
    /// `"response"`.
    pub object: &'static str,
    /// Unix time of the request, seconds.
    pub created_at: u64,
    /// `in_progress`, `completed`, `incomplete` or `failed`.
    pub status: &'static str,
    /// Set when `status` is `failed`: `{"code", "message"}`.
    #[schema(value_type = Option<Object>)]
    pub error: Option<Value>,
    /// Set when `status` is `incomplete`: `{"reason": "max_output_tokens"}`.
    #[schema(value_type = Option<Object>)]
    pub incomplete_details: Option<Value>,
    /// The request's `instructions`.
    pub instructions: Option<String>,
    /// The request's `max_output_tokens`.
    pub max_output_tokens: Option<i64>,
    /// The model name the request asked for (the served id when it named none).
    pub model: String,
    /// The output items: `reasoning`, `message`, `function_call`.
    #[schema(value_type = Vec<Object>)]
    pub output: Vec<Value>,
    /// Whether several tool calls were allowed.
    pub parallel_tool_calls: bool,
    /// Always `null` (nothing is stored).
    pub previous_response_id: Option<String>,
    /// `{"effort", "summary"}` as asked.
    #[schema(value_type = Object)]
    pub reasoning: Value,
    /// Always false: nothing is stored.
    pub store: bool,
    /// The request's `temperature`.
    pub temperature: Option<f64>,
    /// `{"format": ...}` as asked.
    #[schema(value_type = Object)]
    pub text: Value,
    /// The request's `tool_choice` (default `"auto"`).
    #[schema(value_type = Object)]
    pub tool_choice: Value,
    /// The tools offered (hosted ones left out).
    #[schema(value_type = Vec<Object>)]
    pub tools: Vec<Value>,
    /// The request's `top_p`.
    pub top_p: Option<f64>,
    /// `"disabled"`.
    pub truncation: &'static str,
    /// Token counts (`null` until the response ends).
    pub usage: Option<ResponseUsage>,
    /// The request's `user`.
    pub user: Option<String>,
    /// The request's `metadata` (`{}` when none).
    #[schema(value_type = Object)]
    pub metadata: Map<String, Value>,
}

/// `usage` of a response.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
pub struct ResponseUsage {
    /// Prompt tokens.
    pub input_tokens: usize,
    /// Details of the prompt.
    pub input_tokens_details: InputTokensDetails,
    /// Generated tokens, reasoning included.
    pub output_tokens: usize,
    /// Details of the output.
    pub output_tokens_details: OutputTokensDetails,
    /// The sum.
    pub total_tokens: usize,
}

/// `usage.input_tokens_details`.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
pub struct InputTokensDetails {
    /// Prompt tokens taken from the prefix cache.
    pub cached_tokens: usize,
    /// Always 0 (the prefix cache is filled without charge).
    pub cache_write_tokens: usize,
}

/// `usage.output_tokens_details`.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
pub struct OutputTokensDetails {
    /// Tokens of the reasoning (its text encoded again, at most `output_tokens`).
    pub reasoning_tokens: usize,
}

/// One server-sent event of a streamed response: `type` names it (`response.created`, `response.in_progress`,
/// `response.output_item.added`, `response.content_part.added`, `response.output_text.delta`,
/// `response.output_text.done`, `response.content_part.done`, `response.reasoning_text.delta`/`.done`,
/// `response.reasoning_summary_part.added`/`.done`, `response.reasoning_summary_text.delta`/`.done`,
/// `response.function_call_arguments.delta`/`.done`, `response.output_item.done`, and last
/// `response.completed`, `response.incomplete` or `response.failed`); the other fields are the event's, as in
/// OpenAI's API reference.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ResponseStreamEvent {
    /// The event type.
    #[serde(rename = "type")]
    pub kind: String,
    /// 0, 1, … in the stream.
    pub sequence_number: usize,
    /// The event's fields.
    #[serde(flatten)]
    #[schema(value_type = Object)]
    pub fields: Map<String, Value>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::{MessageContent, Role};

    fn parse(body: Value) -> Result<(ChatCompletionRequest, ResponsesPlan), ApiError> {
        let req: CreateResponseRequest =
            serde_json::from_value(body).map_err(|e| ApiError::invalid(e.to_string(), ""))?;
        to_chat_request(&req, &ReasoningSeal::random())
    }

    #[test]
    fn items_become_chat_messages() {
        let seal = ReasoningSeal::random();
        let blob = seal.seal("I thought.");
        let req: CreateResponseRequest = serde_json::from_value(json!({
            "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d1"}]},
                {"type": "message", "role": "user", "id": "msg_1", "content": [{"type": "input_text", "text": "hi"}]},
                {"type": "message", "role": "developer", "content": "d2"},
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": blob},
                {"type": "function_call", "call_id": "c1", "name": "list", "namespace": "mcp__fs__", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
                {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "garbage"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
            ],
            "tools": [
                {"type": "function", "name": "shell", "parameters": {"type": "object"}, "strict": false},
                {"type": "namespace", "name": "mcp__fs__", "description": "files",
                 "tools": [{"type": "function", "name": "list", "parameters": {"type": "object"}}]},
                {"type": "web_search"}
            ],
            "include": ["reasoning.encrypted_content"],
            "reasoning": {"summary": "auto"},
            "store": false
        }))
        .unwrap();
        let (chat, plan) = to_chat_request(&req, &seal).unwrap();
        let m = &chat.messages;
        assert_eq!(m[0].role, Role::System);
        assert_eq!(m[0].content, Some(MessageContent::Text("d1\n\nd2".into())));
        assert_eq!(m[2].reasoning_content.as_deref(), Some("I thought."));
        assert_eq!(m[2].tool_calls.as_ref().unwrap()[0].function.name, "mcp__fs__list");
        assert_eq!(m[3].role, Role::Tool);
        // The unreadable blob is ignored; the text stays.
        assert_eq!(m[4].reasoning_content, None);
        assert_eq!(m[4].content, Some(MessageContent::Text("done".into())));
        assert_eq!(chat.tools.as_ref().unwrap().len(), 2);
        assert_eq!(plan.namespaced["mcp__fs__list"], ("mcp__fs__".to_owned(), "list".to_owned()));
        assert!(plan.summary && plan.encrypted);
    }

    #[test]
    fn refused_fields_name_themselves() {
        for (body, param) in [
            (json!({"input": "x", "previous_response_id": "resp_1"}), "previous_response_id"),
            (json!({"input": [{"type": "item_reference", "id": "x"}]}), "input[0].type"),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]}),
                "input[0].content[0].file_id",
            ),
            (json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}), "input[0].content[0]"),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"},
                    {"type": "input_file", "file_id": "f"}]}]}),
                "input[0].content[1].type",
            ),
            (json!({"input": 5}), "input"),
            (json!({"input": "x", "text": {"format": {"type": "yaml"}}}), "text.format.type"),
        ] {
            match parse(body.clone()) {
                Err(ApiError::InvalidRequest { param: Some(p), .. }) => assert_eq!(p, param, "{body}"),
                other => panic!("{body}: {other:?}"),
            }
        }
        assert!(serde_json::from_value::<CreateResponseRequest>(json!({"input": "x", "bogus": 1})).is_err());
    }
}
