//! The OpenAI wire types this server reads and writes (chat completions and models), as serde structs.
//!
//! Requests are parsed leniently where OpenAI clients differ (`null` for absent, `stop` as a string or a list,
//! `content` as a string or a list of parts) and strictly where a wrong type means a broken client (a number for
//! `messages`): type errors become 400s naming the field. Fields a request may carry but this server cannot honour
//! are declared here so that the handler can refuse them instead of silently ignoring them.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Body of `POST /v1/chat/completions`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChatCompletionRequest {
    /// Model id; must be the served one (absent: the served one).
    pub model: Option<String>,
    /// The conversation so far (at least one message).
    pub messages: Vec<ChatMessage>,
    /// Most tokens to generate (legacy name of `max_completion_tokens`).
    pub max_tokens: Option<i64>,
    /// Most tokens to generate, reasoning included; wins over `max_tokens`.
    pub max_completion_tokens: Option<i64>,
    /// Softmax temperature in [0, 2]; 0 is greedy.
    pub temperature: Option<f64>,
    /// Nucleus sampling mass in (0, 1].
    pub top_p: Option<f64>,
    /// Keep the k most likely tokens; 0 or -1 = no limit.
    pub top_k: Option<i64>,
    /// Drop tokens below `min_p` x the most likely token's probability, in [0, 1].
    pub min_p: Option<f64>,
    /// Seed of the request's random generator (reproducible sampling).
    pub seed: Option<i64>,
    /// Up to 4 strings that end generation; the matched string is not returned.
    pub stop: Option<StopSequences>,
    /// Stream the answer as server-sent events.
    pub stream: Option<bool>,
    /// Options of the stream.
    pub stream_options: Option<StreamOptions>,
    /// Tools the model may call: `[{"type": "function", "function": {"name", "description", "parameters"}}]`,
    /// kept as sent because the chat template prints them verbatim.
    pub tools: Option<Vec<Map<String, Value>>>,
    /// `"auto"` (default) or `"none"`; forcing a call is not supported yet.
    pub tool_choice: Option<Value>,
    /// Whether several tool calls may come in one turn (the model decides; accepted for compatibility).
    pub parallel_tool_calls: Option<bool>,
    /// Extra chat-template variables (`enable_thinking`, `preserve_thinking`, ...).
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// `none` (thinking off), `low`, `medium` or `xhigh` (the template's default).
    pub reasoning_effort: Option<String>,
    /// Number of choices; only 1 is served.
    pub n: Option<i64>,
    /// Not supported yet; refused unless 0.
    pub presence_penalty: Option<f64>,
    /// Not supported yet; refused unless 0.
    pub frequency_penalty: Option<f64>,
    /// Not supported yet; refused when true.
    pub logprobs: Option<bool>,
    /// Not supported yet; refused when set.
    pub top_logprobs: Option<i64>,
    /// Only `{"type": "text"}` is supported yet.
    pub response_format: Option<Value>,
    /// Nebula/vLLM extension: keep generating past the end of the turn until `max_tokens` (benchmarks).
    pub ignore_eos: Option<bool>,
    /// End-user id (logged nowhere; accepted for compatibility).
    pub user: Option<String>,
}

/// `stop`: one string or a list of them.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum StopSequences {
    /// A single stop string.
    One(String),
    /// Several stop strings.
    Many(Vec<String>),
}

impl StopSequences {
    /// The stop strings as a list.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send one last chunk with `choices: []` and the request's usage.
    pub include_usage: Option<bool>,
}

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions (first message only, by the Qwen template's rule).
    System,
    /// The user.
    User,
    /// The model (history turns).
    Assistant,
    /// A tool's result.
    Tool,
}

/// One message of the conversation. Serialized back (nulls left out) for the chat template.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// Who wrote it.
    pub role: Role,
    /// Its text: a string or a list of text parts (`null` for an assistant turn that only calls tools).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<MessageContent>,
    /// The reasoning of an earlier assistant turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The tool calls of an earlier assistant turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallMessage>>,
    /// The call a tool message answers (pairing is by order in the Qwen template).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Name of the author or tool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// Message content: a string or a list of parts.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// A list of parts, kept as sent; the handler accepts only `{"type": "text", "text": ...}` (this model reads
    /// no images) and says which part it refuses.
    Parts(Vec<Map<String, Value>>),
}

impl<'de> Deserialize<'de> for MessageContent {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ContentVisitor;
        impl<'de> serde::de::Visitor<'de> for ContentVisitor {
            type Value = MessageContent;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string or a list of content parts")
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Self::Value, E> {
                Ok(MessageContent::Text(text.to_owned()))
            }
            fn visit_string<E: serde::de::Error>(self, text: String) -> Result<Self::Value, E> {
                Ok(MessageContent::Text(text))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                Deserialize::deserialize(serde::de::value::SeqAccessDeserializer::new(seq)).map(MessageContent::Parts)
            }
        }
        deserializer.deserialize_any(ContentVisitor)
    }
}

/// A tool call in an earlier assistant turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCallMessage {
    /// The call's id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `"function"`.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// The function called.
    pub function: FunctionCallMessage,
}

/// The function of a tool call in an earlier assistant turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCallMessage {
    /// Function name.
    pub name: String,
    /// Arguments: a JSON object encoded as a string (OpenAI), or the object itself.
    pub arguments: Value,
}

/// Why a choice ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// End of turn (`<|im_end|>`) or a stop string.
    Stop,
    /// `max_tokens` or the context limit.
    Length,
    /// The turn ended with tool calls.
    ToolCalls,
}

/// Token counts of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Tokens of the rendered prompt.
    pub prompt_tokens: usize,
    /// Tokens generated (reasoning included; the end-of-turn token not counted).
    pub completion_tokens: usize,
    /// The sum.
    pub total_tokens: usize,
}

impl Usage {
    /// Usage of `prompt_tokens` in and `completion_tokens` out.
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self { prompt_tokens, completion_tokens, total_tokens: prompt_tokens + completion_tokens }
    }
}

/// A tool call the model made, in a response message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ToolCall {
    /// Unique id of the call.
    pub id: String,
    /// Always `"function"`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// What was called.
    pub function: FunctionCall,
}

/// Function and arguments of a tool call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FunctionCall {
    /// Function name.
    pub name: String,
    /// The arguments object as a JSON string.
    pub arguments: String,
}

/// A tool call in a stream chunk: the whole call in one delta, with its position.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ToolCallDelta {
    /// Position of the call in the turn (0, 1, ...).
    pub index: usize,
    /// Unique id of the call.
    pub id: String,
    /// Always `"function"`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// What was called.
    pub function: FunctionCall,
}

/// Body of a non-streamed chat completion.
#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletion {
    /// `chatcmpl-…`.
    pub id: String,
    /// `"chat.completion"`.
    pub object: &'static str,
    /// Unix time of the request, seconds.
    pub created: u64,
    /// The served model id.
    pub model: String,
    /// The one choice.
    pub choices: Vec<Choice>,
    /// Token counts.
    pub usage: Usage,
}

/// A choice of a non-streamed completion.
#[derive(Debug, Clone, Serialize)]
pub struct Choice {
    /// Always 0.
    pub index: usize,
    /// The answer.
    pub message: AssistantMessage,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Always `null` (not supported yet).
    pub logprobs: Option<Value>,
}

/// The assistant's message in a non-streamed completion.
#[derive(Debug, Clone, Serialize)]
pub struct AssistantMessage {
    /// Always `"assistant"`.
    pub role: &'static str,
    /// The answer text (`null` when the turn only called tools).
    pub content: Option<String>,
    /// The reasoning (thinking), when there is any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Tool calls, when there are any.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

/// One server-sent event of a streamed completion.
#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletionChunk {
    /// Same id on every chunk of a completion.
    pub id: String,
    /// `"chat.completion.chunk"`.
    pub object: &'static str,
    /// Unix time of the request, seconds.
    pub created: u64,
    /// The served model id.
    pub model: String,
    /// One choice, or none on the final usage chunk.
    pub choices: Vec<ChunkChoice>,
    /// `null`, except on the final chunk when `stream_options.include_usage` is set.
    pub usage: Option<Usage>,
}

/// The choice of a stream chunk.
#[derive(Debug, Clone, Serialize)]
pub struct ChunkChoice {
    /// Always 0.
    pub index: usize,
    /// What this chunk adds.
    pub delta: Delta,
    /// Set on the last chunk of the choice.
    pub finish_reason: Option<FinishReason>,
    /// Always `null` (not supported yet).
    pub logprobs: Option<Value>,
}

/// What a stream chunk adds to the message. Absent fields are left out.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Delta {
    /// `"assistant"` on the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// More answer text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// More reasoning text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Tool calls completed by this chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// Body of `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    /// `"list"`.
    pub object: &'static str,
    /// The served model.
    pub data: Vec<ModelCard>,
}

/// One served model.
#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    /// The id requests name in `model`.
    pub id: String,
    /// `"model"`.
    pub object: &'static str,
    /// Unix time the model was loaded, seconds.
    pub created: u64,
    /// `"nebula"`.
    pub owned_by: &'static str,
    /// Longest prompt + completion served, tokens.
    pub max_model_len: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_take_strings_parts_and_tool_calls() {
        let req: ChatCompletionRequest = serde_json::from_value(serde_json::json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
                {"role": "tool", "content": "42", "tool_call_id": "c0"}
            ],
            "stop": "x",
            "max_tokens": null
        }))
        .unwrap();
        assert_eq!(req.messages.len(), 4);
        assert_eq!(req.stop, Some(StopSequences::One("x".into())));
        assert_eq!(req.max_tokens, None);
        // Back to JSON for the template: nulls dropped.
        let assistant = serde_json::to_value(&req.messages[2]).unwrap();
        assert!(assistant.get("content").is_none());
        assert_eq!(assistant["tool_calls"][0]["function"]["arguments"], "{\"a\": 1}");
    }

    #[test]
    fn unknown_roles_are_refused() {
        let bad_role = serde_json::json!({"messages": [{"role": "developer", "content": "x"}]});
        let err = serde_json::from_value::<ChatCompletionRequest>(bad_role).unwrap_err();
        assert!(err.to_string().contains("unknown variant `developer`"), "{err}");
    }

    #[test]
    fn chunks_serialize_usage_as_null() {
        let chunk = ChatCompletionChunk {
            id: "chatcmpl-1".into(),
            object: "chat.completion.chunk",
            created: 1,
            model: "m".into(),
            choices: vec![ChunkChoice {
                index: 0,
                delta: Delta { role: Some("assistant"), content: Some(String::new()), ..Delta::default() },
                finish_reason: None,
                logprobs: None,
            }],
            usage: None,
        };
        let v = serde_json::to_value(chunk).unwrap();
        assert_eq!(v["usage"], Value::Null);
        assert_eq!(v["choices"][0]["delta"], serde_json::json!({"role": "assistant", "content": ""}));
        assert_eq!(v["choices"][0]["finish_reason"], Value::Null);
    }
}
