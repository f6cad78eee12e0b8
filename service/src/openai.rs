//! The OpenAI wire types this server reads and writes (chat completions and models), as serde structs.
//!
//! Requests are parsed leniently where OpenAI clients differ (`null` for absent, `stop` as a string or a list,
//! `content` as a string or a list of parts) and strictly where a wrong type means a broken client (a number for
//! `messages`): type errors become 400s naming the field. Fields a request may carry but this server cannot honour
//! are declared here so that the handler can refuse them instead of silently ignoring them.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use utoipa::ToSchema;

/// Body of `POST /v1/chat/completions`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[schema(example = json!({"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 64, "temperature": 0}))]
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
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Vec<Map<String, Value>>>,
    /// `"auto"` (default), `"none"`, `"required"` (a call is forced by constrained decoding), or
    /// `{"type": "function", "function": {"name": ...}}` (that function is forced).
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// Whether several tool calls may come in one turn (default true; false limits a forced call to one).
    pub parallel_tool_calls: Option<bool>,
    /// Extra chat-template variables (`enable_thinking`, `preserve_thinking`, ...).
    #[schema(value_type = Option<Object>)]
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// `none` (thinking off), `minimal` (= `low`), `low`, `medium`, `high` (= `xhigh`) or `xhigh` (the
    /// template's default).
    pub reasoning_effort: Option<String>,
    /// Number of choices, 1 to 8, decoded together from one prefill of the prompt (with `seed`, choice i uses
    /// `seed + i`, and equals a single request with that seed).
    pub n: Option<i64>,
    /// OpenAI presence penalty in [-2, 2].
    pub presence_penalty: Option<f64>,
    /// OpenAI frequency penalty in [-2, 2].
    pub frequency_penalty: Option<f64>,
    /// vLLM/HF repetition penalty, > 0 (1 = off).
    pub repetition_penalty: Option<f64>,
    /// Return the log-probability of each output token.
    pub logprobs: Option<bool>,
    /// With `logprobs`, also the 0 to 20 most likely alternatives of each token.
    pub top_logprobs: Option<i64>,
    /// `{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {"name",
    /// "schema", "strict"}}`; the JSON modes are enforced by constrained decoding after the reasoning.
    #[schema(value_type = Option<Object>)]
    pub response_format: Option<Value>,
    /// Nebula: MTP verification level, 1 (fastest) to 3 (exact greedy; default).
    pub accuracy_level: Option<i64>,
    /// Nebula: a context limit for this request, at most the server's (the WebUI's context selector).
    pub max_context: Option<i64>,
    /// Nebula: prompt tokens per prefill chunk for this request, at most the server's (the WebUI's prefill
    /// selector).
    pub max_prefill: Option<i64>,
    /// Nebula/vLLM extension: keep generating past the end of the turn until `max_tokens` (benchmarks).
    pub ignore_eos: Option<bool>,
    /// End-user id (logged nowhere; accepted for compatibility).
    pub user: Option<String>,
}

/// `stop`: one string or a list of them.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, ToSchema)]
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
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct StreamOptions {
    /// Send one last chunk with `choices: []` and the request's usage.
    pub include_usage: Option<bool>,
}

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions; `developer` (OpenAI's newer name for them) is read as `system`. Several, or one after the
    /// first message, are folded into one first system turn ([`crate::chat::fold_system_messages`]).
    #[serde(alias = "developer")]
    System,
    /// The user.
    User,
    /// The model (history turns).
    Assistant,
    /// A tool's result.
    Tool,
}

/// One message of the conversation. Serialized back (nulls left out) for the chat template.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
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
    /// A list of parts, kept as sent; the handler accepts `{"type": "text", "text": ...}` and, with a vision
    /// tower loaded, `{"type": "image_url", "image_url": {"url": "data:..."}}`, and says which part it refuses.
    Parts(Vec<Map<String, Value>>),
}

impl utoipa::PartialSchema for MessageContent {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, OneOfBuilder, Type};
        let image_url = ObjectBuilder::new()
            .property("url", ObjectBuilder::new().schema_type(Type::String))
            .property("detail", ObjectBuilder::new().schema_type(Type::String))
            .required("url");
        let part = ObjectBuilder::new()
            .property("type", ObjectBuilder::new().schema_type(Type::String))
            .property("text", ObjectBuilder::new().schema_type(Type::String))
            .property("image_url", image_url)
            .required("type");
        OneOfBuilder::new()
            .item(ObjectBuilder::new().schema_type(Type::String))
            .item(ArrayBuilder::new().items(part))
            .description(Some(
                "A string, or a list of `{\"type\": \"text\", \"text\": ...}` parts and, with a vision tower \
                 loaded, `{\"type\": \"image_url\", \"image_url\": {\"url\": \"data:image/png;base64,...\"}}` parts.",
            ))
            .into()
    }
}

impl ToSchema for MessageContent {}

impl MessageContent {
    /// The text of the content: the string, or the text parts joined (other parts are refused earlier).
    pub fn text(&self) -> String {
        match self {
            Self::Text(t) => t.clone(),
            Self::Parts(parts) => parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect(),
        }
    }
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FunctionCallMessage {
    /// Function name.
    pub name: String,
    /// Arguments: a JSON object encoded as a string (OpenAI), or the object itself.
    #[schema(value_type = Object)]
    pub arguments: Value,
}

/// Why a choice ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// End of turn (`<|im_end|>`) or a stop string.
    Stop,
    /// `max_tokens`, the context limit, or the repetition guard.
    Length,
    /// The turn ended with tool calls.
    ToolCalls,
}

/// Token counts of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
pub struct Usage {
    /// Tokens of the rendered prompt (per choice, as OpenAI counts `n`: once).
    pub prompt_tokens: usize,
    /// Tokens generated, all choices together (reasoning included; the end-of-turn token not counted).
    pub completion_tokens: usize,
    /// The sum.
    pub total_tokens: usize,
    /// Details of the prompt.
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, ToSchema)]
pub struct PromptTokensDetails {
    /// Prompt tokens taken from the prefix cache (not prefilled).
    pub cached_tokens: usize,
    /// Prompt tokens that stand for images (the vision tower's features at the image pad tokens); absent for a
    /// text prompt.
    #[serde(skip_serializing_if = "is_zero")]
    pub image_tokens: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl Usage {
    /// Usage of `prompt_tokens` in (of which `cached_tokens` from the prefix cache) and `completion_tokens` out.
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails::default(),
        }
    }

    /// The same usage with `cached_tokens` set.
    pub fn with_cached(mut self, cached_tokens: usize) -> Self {
        self.prompt_tokens_details.cached_tokens = cached_tokens;
        self
    }

    /// The same usage with `image_tokens` set.
    pub fn with_images(mut self, image_tokens: usize) -> Self {
        self.prompt_tokens_details.image_tokens = image_tokens;
        self
    }

    /// The same usage with these prompt details (merging the choices of one request).
    pub fn with_details(mut self, details: PromptTokensDetails) -> Self {
        self.prompt_tokens_details = details;
        self
    }
}

/// llama.cpp-style timings of a request (`timings` of llama-server responses), milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, ToSchema)]
pub struct Timings {
    /// Prompt tokens taken from the prefix cache.
    pub cache_n: usize,
    /// Prompt tokens prefilled.
    pub prompt_n: usize,
    /// Prefill time.
    pub prompt_ms: f64,
    /// Prefill time per prefilled token.
    pub prompt_per_token_ms: f64,
    /// Prefilled tokens per second.
    pub prompt_per_second: f64,
    /// Tokens generated.
    pub predicted_n: usize,
    /// Decode time (after the first token).
    pub predicted_ms: f64,
    /// Decode time per token.
    pub predicted_per_token_ms: f64,
    /// Generated tokens per second.
    pub predicted_per_second: f64,
    /// MTP draft tokens proposed (llama-server's speculative-decoding field).
    pub draft_n: usize,
    /// Of those, accepted.
    pub draft_n_accepted: usize,
}

impl Timings {
    /// Timings from counts and times.
    pub fn new(cache_n: usize, prompt_n: usize, prompt_ms: f64, predicted_n: usize, predicted_ms: f64) -> Self {
        let per = |ms: f64, n: usize| if n > 0 { ms / n as f64 } else { 0.0 };
        let rate = |ms: f64, n: usize| if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 };
        Self {
            cache_n,
            prompt_n,
            prompt_ms,
            prompt_per_token_ms: per(prompt_ms, prompt_n),
            prompt_per_second: rate(prompt_ms, prompt_n),
            predicted_n,
            predicted_ms,
            predicted_per_token_ms: per(predicted_ms, predicted_n),
            predicted_per_second: rate(predicted_ms, predicted_n),
            draft_n: 0,
            draft_n_accepted: 0,
        }
    }

    /// With the request's MTP draft counts.
    pub fn with_drafts(mut self, draft_n: usize, draft_n_accepted: usize) -> Self {
        self.draft_n = draft_n;
        self.draft_n_accepted = draft_n_accepted;
        self
    }
}

/// A tool call the model made, in a response message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct FunctionCall {
    /// Function name.
    pub name: String,
    /// The arguments object as a JSON string.
    pub arguments: String,
}

/// A piece of a tool call in a stream chunk. The first piece of a call has `id`, `type` and `function.name`
/// with empty `arguments`; later pieces add argument text. A call's pieces concatenate to a JSON object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct ToolCallDelta {
    /// Position of the call in the turn (0, 1, ...).
    pub index: usize,
    /// Unique id of the call (first piece only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `"function"` (first piece only).
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    /// Name (first piece) and argument text.
    pub function: FunctionCallDelta,
}

/// The function part of a [`ToolCallDelta`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct FunctionCallDelta {
    /// Function name (first piece only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// More argument text.
    pub arguments: String,
}

/// Log-probability of one output token (OpenAI `ChatCompletionTokenLogprob`).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct TokenLogprob {
    /// The token's text (invalid UTF-8 shows as U+FFFD; `bytes` has the exact bytes).
    pub token: String,
    /// Natural log of its probability.
    pub logprob: f32,
    /// The token's UTF-8 bytes.
    pub bytes: Option<Vec<u8>>,
    /// The most likely tokens at this position, most likely first.
    pub top_logprobs: Vec<TopLogprob>,
}

/// An alternative token at a position.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct TopLogprob {
    /// The token's text.
    pub token: String,
    /// Natural log of its probability.
    pub logprob: f32,
    /// The token's UTF-8 bytes.
    pub bytes: Option<Vec<u8>>,
}

/// `choices[].logprobs`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, ToSchema)]
pub struct ChoiceLogprobs {
    /// One entry per output token, reasoning and answer alike.
    pub content: Vec<TokenLogprob>,
}

/// Body of a non-streamed chat completion.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatCompletion {
    /// `chatcmpl-…`.
    pub id: String,
    /// `"chat.completion"`.
    pub object: &'static str,
    /// Unix time of the request, seconds.
    pub created: u64,
    /// The served model id.
    pub model: String,
    /// The choices, `n` of them.
    pub choices: Vec<Choice>,
    /// Token counts.
    pub usage: Usage,
    /// llama.cpp-style timings (of the first choice).
    pub timings: Timings,
}

/// A choice of a non-streamed completion.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Choice {
    /// Position among the choices.
    pub index: usize,
    /// The answer.
    pub message: AssistantMessage,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Log-probabilities when asked for, else `null`.
    pub logprobs: Option<ChoiceLogprobs>,
}

/// The assistant's message in a non-streamed completion.
#[derive(Debug, Clone, Serialize, ToSchema)]
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
#[derive(Debug, Clone, Serialize, ToSchema)]
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
    /// llama.cpp-style timings, on the last chunk of each choice.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

/// The choice of a stream chunk.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChunkChoice {
    /// Position among the choices.
    pub index: usize,
    /// What this chunk adds.
    pub delta: Delta,
    /// Set on the last chunk of the choice.
    pub finish_reason: Option<FinishReason>,
    /// Log-probabilities of this chunk's tokens when asked for, else `null`.
    pub logprobs: Option<ChoiceLogprobs>,
}

/// What a stream chunk adds to the message. Absent fields are left out.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, ToSchema)]
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
    /// Tool call pieces.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// Body of `GET /v1/models`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelList {
    /// `"list"`.
    pub object: &'static str,
    /// The served model.
    pub data: Vec<ModelCard>,
}

/// One served model.
#[derive(Debug, Clone, Serialize, ToSchema)]
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
    /// Prompt tokens per prefill chunk.
    pub max_prefill: usize,
    /// Input modalities: `["text"]`, and `"image"` when a vision tower is loaded.
    pub input_modalities: Vec<&'static str>,
    /// Output modalities (`["text"]`).
    pub output_modalities: Vec<&'static str>,
    /// The hardware profile file's content (`NEBULA_PROFILE`), `null` when none is configured.
    #[schema(value_type = Option<Object>)]
    pub profile: Option<Value>,
}

/// Body of `POST /v1/completions` (legacy text completion).
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[schema(example = json!({"prompt": "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n", "max_tokens": 16}))]
pub struct CompletionRequest {
    /// Model id; must be the served one (absent: the served one).
    pub model: Option<String>,
    /// The prompt: raw text, sent to the model as is (no chat template; special tokens in it are honoured).
    pub prompt: PromptInput,
    /// Most tokens to generate (default 16, as OpenAI).
    pub max_tokens: Option<i64>,
    /// Softmax temperature in [0, 2].
    pub temperature: Option<f64>,
    /// Nucleus sampling mass in (0, 1].
    pub top_p: Option<f64>,
    /// Top-k (0 or -1: no limit).
    pub top_k: Option<i64>,
    /// Min-p in [0, 1].
    pub min_p: Option<f64>,
    /// Seed.
    pub seed: Option<i64>,
    /// Up to 4 stop strings.
    pub stop: Option<StopSequences>,
    /// Stream as server-sent events.
    pub stream: Option<bool>,
    /// Options of the stream.
    pub stream_options: Option<StreamOptions>,
    /// Number of choices, 1 to 8.
    pub n: Option<i64>,
    /// Presence penalty in [-2, 2].
    pub presence_penalty: Option<f64>,
    /// Frequency penalty in [-2, 2].
    pub frequency_penalty: Option<f64>,
    /// Repetition penalty, > 0.
    pub repetition_penalty: Option<f64>,
    /// Log-probabilities of each token with this many alternatives (0 to 5).
    pub logprobs: Option<i64>,
    /// Prepend the prompt to the returned text.
    pub echo: Option<bool>,
    /// Text after the completion; not supported (refused unless empty).
    pub suffix: Option<String>,
    /// Not supported (refused unless equal to `n`).
    pub best_of: Option<i64>,
    /// Keep generating past the end of text until `max_tokens`.
    pub ignore_eos: Option<bool>,
    /// Nebula: MTP verification level, 1 (fastest) to 3 (exact greedy; default), as in chat completions.
    pub accuracy_level: Option<i64>,
    /// End-user id (accepted, unused).
    pub user: Option<String>,
}

/// `prompt` of a completion: one string or one array of token ids (a list of exactly one of either is accepted
/// too).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum PromptInput {
    /// The prompt text.
    One(String),
    /// A list of prompts; only one is served per request.
    Many(Vec<String>),
    /// The prompt as token ids.
    Tokens(Vec<u32>),
    /// A list of token-id prompts; only one is served per request.
    TokenLists(Vec<Vec<u32>>),
}

impl Default for PromptInput {
    fn default() -> Self {
        Self::One(String::new())
    }
}

/// Body of a text completion.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Completion {
    /// `cmpl-…`.
    pub id: String,
    /// `"text_completion"`.
    pub object: &'static str,
    /// Unix time, seconds.
    pub created: u64,
    /// The served model id.
    pub model: String,
    /// The choices.
    pub choices: Vec<CompletionChoice>,
    /// Token counts (`null` on stream chunks but the usage chunk).
    pub usage: Option<Usage>,
    /// llama.cpp-style timings (non-streamed responses and the last chunk of a choice).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

/// A choice of a text completion.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CompletionChoice {
    /// Position among the choices.
    pub index: usize,
    /// The generated text (or the piece of it, streamed).
    pub text: String,
    /// Why it ended (`null` on stream chunks before the last).
    pub finish_reason: Option<FinishReason>,
    /// Legacy logprobs when asked for.
    pub logprobs: Option<CompletionLogprobs>,
}

/// Legacy `logprobs` of a text completion.
#[derive(Debug, Clone, PartialEq, Default, Serialize, ToSchema)]
pub struct CompletionLogprobs {
    /// Each token's text.
    pub tokens: Vec<String>,
    /// Each token's log-probability.
    pub token_logprobs: Vec<f32>,
    /// Per token, the alternatives and their log-probabilities.
    #[schema(value_type = Vec<Object>)]
    pub top_logprobs: Vec<Map<String, Value>>,
    /// Character offset of each token in `text`.
    pub text_offset: Vec<usize>,
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
    fn unknown_roles_are_refused_and_developer_is_system() {
        let bad_role = serde_json::json!({"messages": [{"role": "robot", "content": "x"}]});
        let err = serde_json::from_value::<ChatCompletionRequest>(bad_role).unwrap_err();
        assert!(err.to_string().contains("unknown variant `robot`"), "{err}");
        let developer = serde_json::json!({"messages": [{"role": "developer", "content": "x"}]});
        let req = serde_json::from_value::<ChatCompletionRequest>(developer).unwrap();
        assert_eq!(req.messages[0].role, Role::System);
        assert_eq!(serde_json::to_value(&req.messages[0]).unwrap()["role"], "system");
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
            timings: None,
        };
        let v = serde_json::to_value(chunk).unwrap();
        assert_eq!(v["usage"], Value::Null);
        assert_eq!(v["choices"][0]["delta"], serde_json::json!({"role": "assistant", "content": ""}));
        assert_eq!(v["choices"][0]["finish_reason"], Value::Null);
    }
}
