//! The Anthropic Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) wire types, its request
//! turned into a chat completion request (the same generation path, see [`crate::conversation`]), and its error
//! body.
//!
//! Mapping: `system` (a string or text blocks) and `role: "system"` messages fold into the system message;
//! `tool_result` blocks become tool messages (an `is_error` result is prefixed `Error: `); `thinking` blocks of
//! earlier turns give the model their text (or, when the text was omitted, the text sealed in their
//! `signature`, see [`crate::seal`]); `tool_use` blocks become tool calls. Tools with an `input_schema` are
//! offered as functions (`$schema` dropped); Anthropic-defined tool types (`bash_…`, `text_editor_…`,
//! `web_search_…`, …) are left out with a warning. `tool_choice` `auto`/`any`/`tool`/`none` map to
//! `auto`/`required`/the named function/`none`, `disable_parallel_tool_use` to one call at most. `thinking`
//! `enabled` turns thinking on (`budget_tokens` is accepted; the model's thinking has no budget of its own),
//! `disabled` off, `adaptive` leaves the server's default; `display: "omitted"` returns thinking blocks with empty
//! text and their signature. `output_config.effort` `low`/`medium`/`high`/`max` maps to the reasoning efforts
//! `low`/`medium`/`high`/`xhigh`. `max_tokens` above what the context leaves is clamped to the room left. Image
//! blocks with a `base64` source become chat `image_url` parts (data: URLs; other sources are refused: no network
//! requests, no files); documents are refused (this server reads no documents). Unknown top-level fields are refused, as Anthropic
//! does; `metadata`, `service_tier`, `context_management`, `container` and `cache_control` are accepted and
//! ignored.

use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use utoipa::ToSchema;

use crate::conversation::{Conversation, chat_tool, text_of_parts};
use crate::error::ApiError;
use crate::openai::ChatCompletionRequest;
use crate::seal::ReasoningSeal;

/// Body of `POST /v1/messages`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"model": "nebula-demo", "max_tokens": 256, "messages": [{"role": "user", "content": "Hello!"}]}))]
pub struct MessagesRequest {
    /// Model name: the served id, an alias, or any name with `serve_any_model`.
    pub model: String,
    /// The conversation: `{"role": "user" | "assistant" | "system", "content": string | blocks}`.
    pub messages: Vec<InputMessage>,
    /// Most tokens to generate, thinking included (required); above what the context leaves: clamped.
    pub max_tokens: i64,
    /// System prompt: a string or a list of text blocks.
    #[schema(value_type = Option<Object>)]
    pub system: Option<Value>,
    /// Accepted (`user_id`), ignored.
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Value>,
    /// Strings that end generation (not returned); the one that matched is `stop_sequence`.
    pub stop_sequences: Option<Vec<String>>,
    /// Stream server-sent events.
    pub stream: Option<bool>,
    /// Softmax temperature.
    pub temperature: Option<f64>,
    /// Nucleus sampling mass in (0, 1].
    pub top_p: Option<f64>,
    /// Keep the k most likely tokens.
    pub top_k: Option<i64>,
    /// Tools: `{"name", "description", "input_schema"}` (`cache_control`, `defer_loading`, `strict` accepted).
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Vec<Value>>,
    /// `{"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}`.
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// `{"type": "enabled", "budget_tokens"}`, `{"type": "disabled"}` or `{"type": "adaptive"}`, with `display`.
    #[schema(value_type = Option<Object>)]
    pub thinking: Option<Value>,
    /// Accepted, ignored.
    pub service_tier: Option<String>,
    /// Accepted, ignored.
    #[schema(value_type = Option<Object>)]
    pub context_management: Option<Value>,
    /// `{"effort": "low" | "medium" | "high" | "max"}`.
    #[schema(value_type = Option<Object>)]
    pub output_config: Option<Value>,
    /// Accepted, ignored.
    #[schema(value_type = Option<Object>)]
    pub container: Option<Value>,
    /// Refused unless empty: this server connects to no MCP servers.
    #[schema(value_type = Option<Vec<Object>>)]
    pub mcp_servers: Option<Vec<Value>>,
}

/// Body of `POST /v1/messages/count_tokens`: a messages request without `max_tokens` and the sampling fields.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CountTokensRequest {
    /// Model name.
    pub model: String,
    /// The conversation.
    pub messages: Vec<InputMessage>,
    /// System prompt.
    #[schema(value_type = Option<Object>)]
    pub system: Option<Value>,
    /// Tools.
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Vec<Value>>,
    /// Tool choice.
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// Thinking settings.
    #[schema(value_type = Option<Object>)]
    pub thinking: Option<Value>,
    /// Accepted, ignored.
    #[schema(value_type = Option<Object>)]
    pub context_management: Option<Value>,
    /// Effort.
    #[schema(value_type = Option<Object>)]
    pub output_config: Option<Value>,
    /// Refused unless empty.
    #[schema(value_type = Option<Vec<Object>>)]
    pub mcp_servers: Option<Vec<Value>>,
}

impl From<CountTokensRequest> for MessagesRequest {
    fn from(r: CountTokensRequest) -> Self {
        Self {
            model: r.model,
            messages: r.messages,
            max_tokens: 1,
            system: r.system,
            tools: r.tools,
            tool_choice: r.tool_choice,
            thinking: r.thinking,
            context_management: r.context_management,
            output_config: r.output_config,
            mcp_servers: r.mcp_servers,
            ..Self::default()
        }
    }
}

/// One message of the conversation.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct InputMessage {
    /// `user`, `assistant` or `system`.
    pub role: String,
    /// A string or a list of content blocks.
    #[schema(value_type = Object)]
    pub content: Value,
}

/// Body of `POST /v1/messages/count_tokens`'s answer.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CountTokensResponse {
    /// Tokens of the rendered prompt (what `messages` would prefill).
    pub input_tokens: usize,
}

/// A message the model wrote (`"type": "message"`).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct MessageObject {
    /// `msg_…`.
    pub id: String,
    /// `"message"`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// `"assistant"`.
    pub role: &'static str,
    /// The model name the request asked for.
    pub model: String,
    /// Content blocks: `thinking`, `text`, `tool_use`.
    #[schema(value_type = Vec<Object>)]
    pub content: Vec<Value>,
    /// `end_turn`, `max_tokens`, `stop_sequence` or `tool_use` (`null` in `message_start`).
    pub stop_reason: Option<&'static str>,
    /// The stop sequence that matched, if one did.
    pub stop_sequence: Option<String>,
    /// Token counts.
    pub usage: MessageUsage,
}

/// `usage` of a message.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
pub struct MessageUsage {
    /// Prompt tokens prefilled (not from the prefix cache).
    pub input_tokens: usize,
    /// Tokens generated, thinking included.
    pub output_tokens: usize,
    /// Prompt tokens taken from the prefix cache.
    pub cache_read_input_tokens: usize,
    /// Always 0: the prefix cache is filled without charge.
    pub cache_creation_input_tokens: usize,
}

impl MessageUsage {
    /// From the generation's counts.
    pub fn from_usage(u: &crate::openai::Usage) -> Self {
        let cached = u.prompt_tokens_details.cached_tokens.min(u.prompt_tokens);
        Self {
            input_tokens: u.prompt_tokens - cached,
            output_tokens: u.completion_tokens,
            cache_read_input_tokens: cached,
            cache_creation_input_tokens: 0,
        }
    }
}

/// One server-sent event of a streamed message: `type` is the SSE event name (`message_start`,
/// `content_block_start`, `content_block_delta`, `content_block_stop`, `message_delta`, `message_stop`, `ping`,
/// `error`); the other fields are the event's, as in Anthropic's API reference.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct MessageStreamEvent {
    /// The event type.
    #[serde(rename = "type")]
    pub kind: String,
    /// The event's fields.
    #[serde(flatten)]
    #[schema(value_type = Object)]
    pub fields: Map<String, Value>,
}

/// Anthropic's error body: `{"type": "error", "error": {"type", "message"}}`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AnthropicErrorBody {
    /// `"error"`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The error.
    pub error: AnthropicErrorDetail,
}

/// The fields of an Anthropic error.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AnthropicErrorDetail {
    /// `invalid_request_error`, `authentication_error`, `not_found_error`, `request_too_large`,
    /// `rate_limit_error`, `api_error`, `overloaded_error` or `timeout_error`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// What went wrong, for a person.
    pub message: String,
}

/// The Anthropic status and error type for an error of HTTP status `status`: 503 (loading) becomes 529
/// `overloaded_error`.
pub fn error_kind(status: StatusCode) -> (StatusCode, &'static str) {
    match status.as_u16() {
        400 | 405 | 422 => (status, "invalid_request_error"),
        401 => (status, "authentication_error"),
        403 => (status, "permission_error"),
        404 => (status, "not_found_error"),
        413 => (status, "request_too_large"),
        429 => (status, "rate_limit_error"),
        503 | 529 => (StatusCode::from_u16(529).unwrap_or(status), "overloaded_error"),
        504 => (status, "timeout_error"),
        _ => (status, "api_error"),
    }
}

/// The Anthropic body of an error with `message`, of Anthropic type `kind`.
pub fn error_body(kind: &'static str, message: String) -> AnthropicErrorBody {
    AnthropicErrorBody { kind: "error", error: AnthropicErrorDetail { kind, message } }
}

/// What the handler needs besides the chat request.
#[derive(Debug, Default)]
pub struct MessagesPlan {
    /// Thinking blocks come back without their text (`display: "omitted"`).
    pub omit_thinking: bool,
    /// The stop sequences.
    pub stop_sequences: Vec<String>,
}

/// The text of a system prompt or a `role: "system"` message: a string or text blocks.
fn system_text(value: &Value, param: &str) -> Result<String, ApiError> {
    let text = text_of_parts(value, &["text"], param)?;
    Ok(text)
}

/// Checks `req` and turns it into a chat completion request (model left out: the handler checked it).
///
/// Errors: 400 naming the field (an image block without a `base64` source, documents: "this server reads text
/// only").
pub fn to_chat_request(
    req: &MessagesRequest,
    seal: &ReasoningSeal,
) -> Result<(ChatCompletionRequest, MessagesPlan), ApiError> {
    if req.mcp_servers.as_ref().is_some_and(|m| !m.is_empty()) {
        return Err(ApiError::invalid(
            "`mcp_servers` is not supported: this server connects to no MCP servers.",
            "mcp_servers",
        ));
    }
    if req.messages.is_empty() {
        return Err(ApiError::invalid("`messages` must contain at least one message.", "messages"));
    }
    let mut plan = MessagesPlan::default();
    let mut conv = Conversation::default();
    if let Some(system) = &req.system {
        conv.system(system_text(system, "system")?);
    }
    for (i, m) in req.messages.iter().enumerate() {
        let param = format!("messages[{i}]");
        add_message(&mut conv, m, &param, seal)?;
    }
    let mut kwargs = Map::new();
    let mut effort = None;
    if let Some(thinking) = &req.thinking {
        match thinking.get("type").and_then(Value::as_str) {
            Some("enabled") => {
                kwargs.insert("enable_thinking".into(), Value::Bool(true));
            }
            Some("disabled") => {
                kwargs.insert("enable_thinking".into(), Value::Bool(false));
            }
            Some("adaptive") => {}
            _ => {
                return Err(ApiError::invalid(
                    "`thinking.type` must be \"enabled\", \"disabled\" or \"adaptive\".",
                    "thinking.type",
                ));
            }
        }
        match thinking.get("display").and_then(Value::as_str) {
            None | Some("summarized") => {}
            Some("omitted") => plan.omit_thinking = true,
            Some(other) => {
                return Err(ApiError::invalid(
                    format!("`thinking.display` must be \"summarized\" or \"omitted\", got `{other}`."),
                    "thinking.display",
                ));
            }
        }
    }
    if let Some(e) = req.output_config.as_ref().and_then(|c| c.get("effort")).filter(|e| !e.is_null()) {
        effort = Some(match e.as_str() {
            Some("low") => "low",
            Some("medium") => "medium",
            Some("high") => "high",
            Some("max") => "xhigh",
            _ => {
                return Err(ApiError::invalid(
                    "`output_config.effort` must be \"low\", \"medium\", \"high\" or \"max\".",
                    "output_config.effort",
                ));
            }
        });
    }
    let tools = convert_tools(req.tools.as_deref().unwrap_or_default())?;
    let (tool_choice, parallel) = convert_tool_choice(req.tool_choice.as_ref())?;
    let stops = req.stop_sequences.clone().unwrap_or_default();
    if stops.iter().any(String::is_empty) {
        return Err(ApiError::invalid("`stop_sequences` must not contain empty strings.", "stop_sequences"));
    }
    plan.stop_sequences = stops;
    let chat = ChatCompletionRequest {
        messages: conv.into_messages(),
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        tools: (!tools.is_empty()).then_some(tools),
        tool_choice,
        parallel_tool_calls: parallel,
        reasoning_effort: effort.map(str::to_owned),
        chat_template_kwargs: (!kwargs.is_empty()).then_some(kwargs),
        ..ChatCompletionRequest::default()
    };
    Ok((chat, plan))
}

fn add_message(conv: &mut Conversation, m: &InputMessage, param: &str, seal: &ReasoningSeal) -> Result<(), ApiError> {
    let content = format!("{param}.content");
    match m.role.as_str() {
        "system" => conv.system(system_text(&m.content, &content)?),
        "user" => match &m.content {
            Value::String(s) => conv.user(s.clone()),
            Value::Array(blocks) if blocks.iter().any(|b| b.get("type").and_then(Value::as_str) == Some("image")) => {
                user_blocks_with_images(conv, blocks, &content)?;
            }
            Value::Array(blocks) => {
                let mut text = String::new();
                for (j, block) in blocks.iter().enumerate() {
                    let bparam = format!("{content}[{j}]");
                    match block_type(block, &bparam)? {
                        "text" => text.push_str(&need_text(block, "text", &bparam)?),
                        "tool_result" => {
                            if !text.is_empty() {
                                conv.user(std::mem::take(&mut text));
                            }
                            let id = need_text(block, "tool_use_id", &bparam)?;
                            let result = match block.get("content") {
                                None => String::new(),
                                Some(c) => text_of_parts(c, &["text"], &format!("{bparam}.content"))?,
                            };
                            let is_error = block.get("is_error").and_then(Value::as_bool).unwrap_or(false);
                            conv.tool_result(id, if is_error { format!("Error: {result}") } else { result });
                        }
                        "image" | "document" | "search_result" | "container_upload" => {
                            return Err(unsupported(block, &bparam));
                        }
                        "thinking" | "redacted_thinking" => {}
                        other => return Err(unknown_block(other, &bparam)),
                    }
                }
                if !text.is_empty() {
                    conv.user(text);
                }
            }
            _ => return Err(ApiError::invalid("`content` must be a string or a list of content blocks.", content)),
        },
        "assistant" => match &m.content {
            Value::String(s) => conv.assistant_text(s.clone()),
            Value::Array(blocks) => {
                for (j, block) in blocks.iter().enumerate() {
                    let bparam = format!("{content}[{j}]");
                    match block_type(block, &bparam)? {
                        "text" => conv.assistant_text(need_text(block, "text", &bparam)?),
                        "thinking" => {
                            let text = block.get("thinking").and_then(Value::as_str).unwrap_or("");
                            let text = if text.is_empty() {
                                let signature = block.get("signature").and_then(Value::as_str).unwrap_or("");
                                match seal.open(signature) {
                                    Ok(t) => t,
                                    Err(why) => {
                                        if !signature.is_empty() {
                                            tracing::warn!(
                                                "a thinking block's signature does not open ({why}); ignored"
                                            );
                                        }
                                        String::new()
                                    }
                                }
                            } else {
                                text.to_owned()
                            };
                            if !text.is_empty() {
                                conv.assistant_reasoning(text);
                            }
                        }
                        "redacted_thinking" => {}
                        "tool_use" => {
                            let id = need_text(block, "id", &bparam)?;
                            let name = need_text(block, "name", &bparam)?;
                            let input = block.get("input").cloned().unwrap_or(json!({}));
                            if !input.is_object() {
                                return Err(ApiError::invalid(
                                    "A tool_use block's `input` must be an object.",
                                    format!("{bparam}.input"),
                                ));
                            }
                            conv.assistant_tool_call(id, name, input);
                        }
                        "image" | "document" => return Err(unsupported(block, &bparam)),
                        other => return Err(unknown_block(other, &bparam)),
                    }
                }
            }
            _ => return Err(ApiError::invalid("`content` must be a string or a list of content blocks.", content)),
        },
        other => {
            return Err(ApiError::invalid(
                format!("Unknown role `{other}`: expected user, assistant or system."),
                format!("{param}.role"),
            ));
        }
    }
    Ok(())
}

/// A user message with `image` blocks: text and images in order, as chat `text` / `image_url` parts (a base64
/// source becomes a data: URL).
///
/// Errors: 400 naming the block: a `url` or `file` source (never fetched), a base64 source without `data` or
/// `media_type`, a block other than text or image beside images.
fn user_blocks_with_images(conv: &mut Conversation, blocks: &[Value], param: &str) -> Result<(), ApiError> {
    let mut parts = Vec::with_capacity(blocks.len());
    for (j, block) in blocks.iter().enumerate() {
        let bparam = format!("{param}[{j}]");
        match block_type(block, &bparam)? {
            "text" => parts.push(crate::conversation::text_part(&need_text(block, "text", &bparam)?)),
            "image" => {
                let source = block.get("source").unwrap_or(&Value::Null);
                match source.get("type").and_then(Value::as_str) {
                    Some("base64") => {
                        let media = need_text(source, "media_type", &format!("{bparam}.source"))?;
                        let data = need_text(source, "data", &format!("{bparam}.source"))?;
                        parts.push(crate::conversation::image_part(format!("data:{media};base64,{data}"), &bparam));
                    }
                    Some(kind) => {
                        return Err(ApiError::invalid(
                            format!(
                                "Image sources of type `{kind}` are not read: this server makes no network requests \
                                 and keeps no files. Send the image as a `base64` source."
                            ),
                            format!("{bparam}.source.type"),
                        ));
                    }
                    None => {
                        return Err(ApiError::invalid(
                            "An image block needs a `source` with a `type`.",
                            format!("{bparam}.source"),
                        ));
                    }
                }
            }
            other => {
                return Err(ApiError::invalid(
                    format!("Content blocks of type `{other}` are not supported in a user message with images."),
                    format!("{bparam}.type"),
                ));
            }
        }
    }
    conv.user_parts(parts);
    Ok(())
}

fn block_type<'a>(block: &'a Value, param: &str) -> Result<&'a str, ApiError> {
    block
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::invalid("Each content block needs a string `type`.", format!("{param}.type")))
}

fn need_text(block: &Value, key: &str, param: &str) -> Result<String, ApiError> {
    block
        .get(key)
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| ApiError::invalid(format!("`{param}.{key}` must be a string."), format!("{param}.{key}")))
}

fn unsupported(block: &Value, param: &str) -> ApiError {
    let kind = block.get("type").and_then(Value::as_str).unwrap_or("?");
    ApiError::invalid(
        format!("Content blocks of type `{kind}` are not supported: this server reads text only."),
        format!("{param}.type"),
    )
}

fn unknown_block(kind: &str, param: &str) -> ApiError {
    ApiError::invalid(format!("Unknown or unsupported content block type `{kind}`."), format!("{param}.type"))
}

/// Client tools as chat functions; Anthropic-defined tool types are left out with a warning.
fn convert_tools(tools: &[Value]) -> Result<Vec<Map<String, Value>>, ApiError> {
    let mut out = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        let param = format!("tools[{i}]");
        match tool.get("type").and_then(Value::as_str) {
            None | Some("custom") => {}
            Some(kind) => {
                tracing::warn!(tool = kind, "an Anthropic-defined tool this server cannot run; left out of the prompt");
                continue;
            }
        }
        let name = need_text(tool, "name", &param)?;
        if name.is_empty() {
            return Err(ApiError::invalid("A tool needs a non-empty `name`.", format!("{param}.name")));
        }
        let schema = tool
            .get("input_schema")
            .ok_or_else(|| ApiError::invalid("A tool needs an `input_schema`.", format!("{param}.input_schema")))?;
        if !schema.is_object() {
            return Err(ApiError::invalid("`input_schema` must be an object.", format!("{param}.input_schema")));
        }
        out.push(chat_tool(&name, tool.get("description"), Some(schema)));
    }
    Ok(out)
}

/// `tool_choice` in the chat shape, and `parallel_tool_calls`.
fn convert_tool_choice(choice: Option<&Value>) -> Result<(Option<Value>, Option<bool>), ApiError> {
    let Some(choice) = choice.filter(|c| !c.is_null()) else { return Ok((None, None)) };
    let parallel = choice.get("disable_parallel_tool_use").and_then(Value::as_bool).map(|d| !d);
    let mapped = match choice.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => {
            let name = choice
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::invalid("`tool_choice.name` must be a string.", "tool_choice.name"))?;
            json!({"type": "function", "function": {"name": name}})
        }
        _ => {
            return Err(ApiError::invalid(
                "`tool_choice.type` must be \"auto\", \"any\", \"tool\" or \"none\".",
                "tool_choice.type",
            ));
        }
    };
    Ok((Some(mapped), parallel))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::{MessageContent, Role};

    #[test]
    fn blocks_become_chat_messages() {
        let seal = ReasoningSeal::random();
        let sig = seal.seal("hidden thought");
        let req: MessagesRequest = serde_json::from_value(json!({
            "model": "claude-x", "max_tokens": 100,
            "system": [{"type": "text", "text": "s1", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "s2"}]},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "", "signature": sig},
                    {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "a"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "x"}],
                     "is_error": true, "cache_control": {"type": "ephemeral"}},
                    {"type": "text", "text": "go on"}]},
                {"role": "system", "content": "s3"}
            ],
            "tools": [{"name": "Read", "input_schema": {"$schema": "https://json-schema.org/draft/2020-12/schema",
                "type": "object"}, "defer_loading": true}, {"type": "bash_20250124", "name": "bash"}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "thinking": {"type": "adaptive", "display": "omitted"},
            "output_config": {"effort": "max"}
        }))
        .unwrap();
        let (chat, plan) = to_chat_request(&req, &seal).unwrap();
        let m = &chat.messages;
        assert_eq!(m[0].role, Role::System);
        assert_eq!(m[0].content, Some(MessageContent::Text("s1\n\ns2\n\ns3".into())));
        assert_eq!(m[2].reasoning_content.as_deref(), Some("hidden thought"));
        assert_eq!(m[3].content, Some(MessageContent::Text("Error: x".into())));
        assert_eq!(m[4].content, Some(MessageContent::Text("go on".into())));
        let tools = chat.tools.unwrap();
        assert_eq!(tools.len(), 1);
        assert!(tools[0]["function"]["parameters"].get("$schema").is_none());
        assert_eq!(chat.tool_choice, Some(json!("required")));
        assert_eq!(chat.parallel_tool_calls, Some(false));
        assert_eq!(chat.reasoning_effort.as_deref(), Some("xhigh"));
        assert!(plan.omit_thinking);
    }

    #[test]
    fn images_documents_and_unknown_fields() {
        let user = |content: Value| -> MessagesRequest {
            serde_json::from_value(
                json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": content}]}),
            )
            .unwrap()
        };
        let seal = ReasoningSeal::random();
        // A base64 image becomes a data: URL part, in order with the text.
        let req = user(json!([{"type": "text", "text": "what is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]));
        let (chat, _) = to_chat_request(&req, &seal).unwrap();
        let parts = serde_json::to_value(&chat.messages[0].content).unwrap();
        assert_eq!(parts[0]["type"], "text", "{parts}");
        assert_eq!(parts[1]["image_url"]["url"], "data:image/png;base64,iVBORw0KGgo=", "{parts}");
        // Each malformed or unreadable image names its field.
        for (source, param) in [
            (json!({"type": "base64", "data": ""}), "messages[0].content[0].source.media_type"),
            (json!({"type": "url", "url": "https://example.com/a.png"}), "messages[0].content[0].source.type"),
            (json!({}), "messages[0].content[0].source"),
        ] {
            match to_chat_request(&user(json!([{"type": "image", "source": source}])), &seal) {
                Err(ApiError::InvalidRequest { param: Some(p), .. }) => assert_eq!(p, param, "{source}"),
                other => panic!("{source}: {other:?}"),
            }
        }
        let err = to_chat_request(
            &user(json!([{"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}])),
            &seal,
        )
        .unwrap_err();
        assert!(err.to_string().contains("text only"), "{err}");
        assert!(
            serde_json::from_value::<MessagesRequest>(json!({"model": "m", "max_tokens": 5, "messages": [],
            "bogus": 1}))
            .is_err()
        );
        let missing = serde_json::from_value::<MessagesRequest>(json!({"model": "m", "messages": []}));
        assert!(missing.unwrap_err().to_string().contains("max_tokens"));
        assert_eq!(error_kind(StatusCode::SERVICE_UNAVAILABLE).0.as_u16(), 529);
    }
}
