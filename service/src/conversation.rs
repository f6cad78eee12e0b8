//! A conversation of another API's shape (the Responses API's input items, the Messages API's content blocks)
//! rebuilt as chat messages, so that it takes the chat completion path: the same template rendering, encoding,
//! limits, sampling defaults and constrained decoding ([`crate::chat::prepare`]).
//!
//! Rules: every system or developer text, wherever it stood, is folded in order (joined by blank lines) into one
//! leading system message (the Qwen3.8 template takes one system message, first). Consecutive assistant pieces
//! (reasoning, text, tool calls) form one assistant message; reasoning that follows text or tool calls of the
//! open assistant message starts the next one. A tool result becomes a `tool` message.

use serde_json::{Map, Value};

use crate::chat::PreparedChat;
use crate::error::ApiError;
use crate::openai::{ChatMessage, FunctionCallMessage, MessageContent, Role, ToolCallMessage};

/// Chat messages being built from another API's conversation.
#[derive(Debug, Default)]
pub struct Conversation {
    system: Vec<String>,
    messages: Vec<ChatMessage>,
}

fn message(role: Role) -> ChatMessage {
    ChatMessage { role, content: None, reasoning_content: None, tool_calls: None, tool_call_id: None, name: None }
}

impl Conversation {
    /// System (or developer) text; empty text is skipped.
    pub fn system(&mut self, text: String) {
        if !text.is_empty() {
            self.system.push(text);
        }
    }

    /// A user turn. Consecutive user texts stay separate messages.
    pub fn user(&mut self, text: String) {
        let mut m = message(Role::User);
        m.content = Some(MessageContent::Text(text));
        self.messages.push(m);
    }

    /// A user message of content parts (`text` and `image_url` parts, as chat completions takes them).
    pub fn user_parts(&mut self, parts: Vec<Map<String, Value>>) {
        let mut m = message(Role::User);
        m.content = Some(MessageContent::Parts(parts));
        self.messages.push(m);
    }

    /// The open assistant message, or a new one.
    fn assistant(&mut self) -> &mut ChatMessage {
        if self.messages.last().is_none_or(|m| m.role != Role::Assistant) {
            self.messages.push(message(Role::Assistant));
        }
        let last = self.messages.len() - 1;
        &mut self.messages[last]
    }

    /// Reasoning of an assistant turn. After text or tool calls of the open assistant message it starts a new
    /// assistant message.
    pub fn assistant_reasoning(&mut self, text: String) {
        let open = self.messages.last().is_some_and(|m| m.role == Role::Assistant);
        let used = self.messages.last().is_some_and(|m| m.content.is_some() || m.tool_calls.is_some());
        if open && used {
            self.messages.push(message(Role::Assistant));
        }
        let m = self.assistant();
        match &mut m.reasoning_content {
            Some(r) => {
                r.push_str("\n\n");
                r.push_str(&text);
            }
            None => m.reasoning_content = Some(text),
        }
    }

    /// Answer text of an assistant turn (appended to the open assistant message).
    pub fn assistant_text(&mut self, text: String) {
        let m = self.assistant();
        match &mut m.content {
            Some(MessageContent::Text(t)) => t.push_str(&text),
            _ => m.content = Some(MessageContent::Text(text)),
        }
    }

    /// A tool call of an assistant turn: `arguments` is the JSON object (or its text).
    pub fn assistant_tool_call(&mut self, id: String, name: String, arguments: Value) {
        let m = self.assistant();
        let call = ToolCallMessage {
            id: Some(id),
            kind: Some("function".into()),
            function: FunctionCallMessage { name, arguments },
        };
        m.tool_calls.get_or_insert_with(Vec::new).push(call);
    }

    /// The result of tool call `call_id`.
    pub fn tool_result(&mut self, call_id: String, text: String) {
        let mut m = message(Role::Tool);
        m.content = Some(MessageContent::Text(text));
        m.tool_call_id = Some(call_id);
        self.messages.push(m);
    }

    /// The chat messages: the folded system message first.
    pub fn into_messages(self) -> Vec<ChatMessage> {
        let mut out = Vec::with_capacity(self.messages.len() + 1);
        if !self.system.is_empty() {
            let mut m = message(Role::System);
            m.content = Some(MessageContent::Text(self.system.join("\n\n")));
            out.push(m);
        }
        out.extend(self.messages);
        out
    }
}

/// A tool of the chat completion shape: `{"type": "function", "function": {"name", "description", "parameters"}}`.
/// `$schema` is dropped from the parameters (the template prints the schema to the model, and the grammar
/// compiler reads it as JSON Schema whatever the draft it names).
pub fn chat_tool(name: &str, description: Option<&Value>, parameters: Option<&Value>) -> Map<String, Value> {
    let mut function = Map::new();
    function.insert("name".into(), Value::String(name.to_owned()));
    if let Some(d) = description.filter(|d| !d.is_null()) {
        function.insert("description".into(), d.clone());
    }
    let mut parameters = parameters.cloned().unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}}));
    if let Some(map) = parameters.as_object_mut() {
        map.remove("$schema");
    }
    function.insert("parameters".into(), parameters);
    let mut tool = Map::new();
    tool.insert("type".into(), Value::String("function".into()));
    tool.insert("function".into(), Value::Object(function));
    tool
}

/// The completion budget of a prepared chat whose `max_tokens` was left open (so the engine request holds the
/// room the context leaves): `requested` tokens, checked against that room. With `clamp`, a budget above the
/// room becomes the room (the Messages API, whose clients send fixed large budgets); without, it is a 400 naming
/// `field` and the limit.
///
/// Errors: 400 for a budget below 1, or above the room without `clamp`.
pub fn set_output_budget(
    prepared: &mut PreparedChat,
    requested: Option<i64>,
    field: &str,
    clamp: bool,
) -> Result<(), ApiError> {
    let room = prepared.generation.request.max_tokens;
    let Some(n) = requested else { return Ok(()) };
    let n = crate::chat::positive(n, field)?;
    if !clamp {
        // Over the room: the 400 names the field and the limit.
        crate::chat::check_completion_room(n, field, prepared.prompt_tokens, prepared.prompt_tokens + room)?;
    }
    prepared.generation.request.max_tokens = n.min(room);
    Ok(())
}

/// Text of a tool result or message content given as a string or a list of `{"type": "text", "text"}`-like
/// parts. `text_types` are the part types that carry text; any other type is a 400 naming `param` (this model
/// reads text only).
pub fn text_of_parts(value: &Value, text_types: &[&str], param: &str) -> Result<String, ApiError> {
    match value {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let mut out = String::new();
            for (i, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str);
                match kind {
                    Some(k) if text_types.contains(&k) => match part.get("text").and_then(Value::as_str) {
                        Some(t) => out.push_str(t),
                        None => {
                            return Err(ApiError::invalid(
                                format!("A `{k}` part needs a string `text`."),
                                format!("{param}[{i}].text"),
                            ));
                        }
                    },
                    Some(k) => {
                        return Err(ApiError::invalid(
                            format!("Content of type `{k}` is not supported: this server reads text only."),
                            format!("{param}[{i}].type"),
                        ));
                    }
                    None => {
                        return Err(ApiError::invalid(
                            "A content part needs a string `type`.",
                            format!("{param}[{i}]"),
                        ));
                    }
                }
            }
            Ok(out)
        }
        _ => Err(ApiError::invalid("Content must be a string or a list of content parts.", param)),
    }
}

/// A chat `text` part.
pub fn text_part(text: &str) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("type".into(), Value::String("text".into()));
    m.insert("text".into(), Value::String(text.to_owned()));
    m
}

/// A chat `image_url` part for `url`, remembering `param` (the client's own request path) for its errors.
pub fn image_part(url: String, param: &str) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("type".into(), Value::String("image_url".into()));
    m.insert("image_url".into(), serde_json::json!({ "url": url }));
    m.insert(crate::vision::PARAM_KEY.into(), Value::String(param.to_owned()));
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_texts_fold_first_and_assistant_pieces_merge() {
        let mut c = Conversation::default();
        c.system("one".into());
        c.user("hi".into());
        c.system("two".into());
        c.assistant_reasoning("think".into());
        c.assistant_tool_call("c0".into(), "f".into(), serde_json::json!({"a": 1}));
        c.tool_result("c0".into(), "42".into());
        c.assistant_reasoning("again".into());
        c.assistant_text("done".into());
        let m = c.into_messages();
        assert_eq!(m.len(), 5);
        assert_eq!(m[0].content, Some(MessageContent::Text("one\n\ntwo".into())));
        assert_eq!(m[2].reasoning_content.as_deref(), Some("think"));
        assert_eq!(m[2].tool_calls.as_ref().unwrap().len(), 1);
        assert_eq!(m[3].role, Role::Tool);
        assert_eq!(m[4].reasoning_content.as_deref(), Some("again"));
        assert_eq!(m[4].content, Some(MessageContent::Text("done".into())));
    }

    #[test]
    fn parts_must_be_text() {
        let ok = serde_json::json!([{"type": "input_text", "text": "a"}, {"type": "output_text", "text": "b"}]);
        assert_eq!(text_of_parts(&ok, &["input_text", "output_text"], "input[0].content").unwrap(), "ab");
        let image = serde_json::json!([{"type": "input_image", "image_url": "x"}]);
        let err = text_of_parts(&image, &["input_text"], "input[0].content").unwrap_err();
        assert!(err.to_string().contains("text only"), "{err}");
    }
}
