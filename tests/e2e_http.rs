//! `nebula serve` end to end over real HTTP: the server runs in process on an ephemeral loopback port with the
//! embedded demo model, and a `reqwest` client checks the OpenAI shapes, the demo model's memorized answers
//! (`tests/fixtures/demo/reference_greedy.json`, written by transformers greedy generation in
//! `scripts/make_demo_model.py`), sampling controls, the bad-input table and client disconnects.
//!
//! Most tests share one server; tests that watch the engine's queue or need other settings start their own.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use nebula_service::state::ServedModel;
use nebula_service::{ModelSource, ServerConfig, ServerHandle, start};
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;

const HELLO_ANSWER: &str = "Hello! I am the Nebula demo model. How can I help?";
const HELLO_REASONING: &str = "The user greets me. I answer briefly and offer help.";

/// A server on its own runtime thread, so that it outlives each test's runtime.
struct TestServer {
    base: String,
    model: Arc<ServedModel>,
}

fn test_config() -> ServerConfig {
    ServerConfig { port: 0, ..ServerConfig::default() }
}

/// Starts a server with `config` on a dedicated runtime and waits until its model is loaded.
fn spawn_server(config: ServerConfig) -> TestServer {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        runtime.block_on(async move {
            let handle = start(config).await.expect("the server binds");
            let model = handle.ready().await.expect("the demo model loads");
            tx.send(TestServer { base: handle.base_url(), model }).unwrap();
            // Serve until the test process ends.
            let _ = handle.wait().await;
        });
    });
    rx.recv().expect("the server thread reports its address")
}

fn shared() -> &'static TestServer {
    static SERVER: OnceLock<TestServer> = OnceLock::new();
    SERVER.get_or_init(|| spawn_server(test_config()))
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(120)).build().unwrap()
}

fn hello(extra: Value) -> Value {
    let mut body = json!({"model": "nebula-demo", "messages": [{"role": "user", "content": "Hello!"}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

async fn post_raw(base: &str, body: impl Into<reqwest::Body>) -> (StatusCode, Value) {
    let resp = client()
        .post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = resp.status();
    let text = resp.text().await.unwrap();
    let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("response is not JSON ({e}): {text:?}"));
    (status, value)
}

async fn post(base: &str, body: &Value) -> (StatusCode, Value) {
    post_raw(base, body.to_string()).await
}

/// Posts a streamed request; returns the `data:` payloads, checking that the stream ends with `[DONE]`.
async fn post_stream(base: &str, body: &Value) -> Vec<Value> {
    let resp = client().post(format!("{base}/v1/chat/completions")).json(body).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let text = resp.text().await.unwrap();
    let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "the stream ends with [DONE]: {text}");
    assert_eq!(data.iter().filter(|d| **d == "[DONE]").count(), 1);
    data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect()
}

fn fixture() -> Value {
    let path = nebula_tests::repo_root().join("tests/fixtures/demo/reference_greedy.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn assert_error(status: StatusCode, body: &Value, want_status: StatusCode, want_param: Option<&str>) {
    assert_eq!(status, want_status, "{body}");
    let err = &body["error"];
    assert!(err["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
    assert!(err["type"].is_string(), "{body}");
    assert_eq!(err["param"].as_str(), want_param, "{body}");
    assert!(err.get("code").is_some(), "{body}");
    assert_eq!(body.as_object().unwrap().len(), 1, "only `error` at the top: {body}");
}

#[tokio::test]
async fn health_and_models() {
    let server = shared();
    let resp = client().get(format!("{}/health", server.base)).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.json::<Value>().await.unwrap(), json!({"status": "ok"}));

    let models: Value = client().get(format!("{}/v1/models", server.base)).send().await.unwrap().json().await.unwrap();
    assert_eq!(models["object"], "list");
    let card = &models["data"][0];
    assert_eq!(card["id"], "nebula-demo");
    assert_eq!(card["object"], "model");
    assert_eq!(card["owned_by"], "nebula");
    assert!(card["created"].as_u64().unwrap() > 1_600_000_000);
    assert_eq!(card["max_model_len"].as_u64().unwrap() as usize, server.model.engine.max_context());
}

#[tokio::test]
async fn health_is_503_while_loading_and_requests_wait_for_the_model() {
    let handle: ServerHandle = start(test_config()).await.unwrap();
    let base = handle.base_url();
    // Loading the model takes hundreds of milliseconds; these requests take one.
    let resp = client().get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    let health = resp.json::<Value>().await.unwrap();
    assert_eq!(health["status"], "loading");
    assert!(health["phase"].as_str().is_some_and(|p| !p.is_empty()), "{health}");
    let (status, body) = post(&base, &hello(json!({}))).await;
    assert_error(status, &body, StatusCode::SERVICE_UNAVAILABLE, None);
    assert_eq!(body["error"]["code"], "model_loading");

    handle.ready().await.unwrap();
    let resp = client().get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    handle.shutdown();
    handle.wait().await.unwrap();
}

#[tokio::test]
async fn corrupt_model_stops_the_server_with_an_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken-model.gguf");
    let mut bytes = std::fs::read(nebula_tests::repo_root().join("models/nebula-demo.gguf")).unwrap();
    bytes.truncate(bytes.len() / 2);
    std::fs::write(&path, &bytes).unwrap();
    let handle = start(ServerConfig { model: ModelSource::File(path.clone()), ..test_config() }).await.unwrap();
    let err = handle.wait().await.expect_err("a truncated model must not be served");
    let message = err.to_string();
    assert!(message.contains(&path.display().to_string()), "{message}");
    assert!(message.contains("beyond the end") || message.contains("truncated"), "{message}");
}

#[tokio::test]
async fn non_stream_greedy_answer_matches_the_reference() {
    let server = shared();
    let fixture = fixture();
    let case = &fixture["cases"][0];
    assert_eq!(case["user"], "Hello!");
    let (status, body) = post(&server.base, &hello(json!({"temperature": 0}))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "nebula-demo");
    assert!(body["created"].as_u64().unwrap() > 1_600_000_000);
    let choice = &body["choices"][0];
    assert_eq!(body["choices"].as_array().unwrap().len(), 1);
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["logprobs"], Value::Null);
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], HELLO_ANSWER);
    assert_eq!(choice["message"]["reasoning_content"], HELLO_REASONING);
    assert!(choice["message"].get("tool_calls").is_none());

    // Usage: the prompt is transformers' apply_chat_template ids; the completion is the reference text's tokens
    // (the end-of-turn token not counted).
    let usage = &body["usage"];
    let prompt_ids = case["prompt_ids"].as_array().unwrap().len();
    let completion = case["completion"].as_str().unwrap().strip_suffix("<|im_end|>").unwrap();
    let completion_ids = server.model.engine.tokenizer().encode(completion).unwrap().len();
    assert_eq!(usage["prompt_tokens"].as_u64().unwrap() as usize, prompt_ids);
    assert_eq!(usage["completion_tokens"].as_u64().unwrap() as usize, completion_ids);
    assert_eq!(usage["total_tokens"].as_u64().unwrap() as usize, prompt_ids + completion_ids);

    // The second reference case too.
    let case = &fixture["cases"][1];
    let body = json!({"messages": [{"role": "user", "content": case["user"]}], "temperature": 0});
    let (_, resp) = post(&server.base, &body).await;
    let completion = case["completion"].as_str().unwrap().strip_suffix("<|im_end|>").unwrap();
    let (reasoning, answer) = completion.split_once("</think>").unwrap();
    assert_eq!(resp["choices"][0]["message"]["reasoning_content"], reasoning.trim());
    assert_eq!(resp["choices"][0]["message"]["content"], answer.trim());
}

#[tokio::test]
async fn stream_chunks_have_the_openai_shape() {
    let server = shared();
    let (_, whole) = post(&server.base, &hello(json!({"temperature": 0}))).await;
    let chunks = post_stream(
        &server.base,
        &hello(json!({"temperature": 0, "stream": true, "stream_options": {"include_usage": true}})),
    )
    .await;
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    for chunk in &chunks {
        assert_eq!(chunk["id"], id);
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["model"], "nebula-demo");
        assert_eq!(chunk["created"], chunks[0]["created"]);
    }
    assert_eq!(chunks[0]["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
    // The usage chunk is last, with no choices; every other chunk has `usage: null`.
    let (usage_chunk, choice_chunks) = chunks.split_last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"], whole["usage"]);
    let (finish_chunk, deltas) = choice_chunks.split_last().unwrap();
    assert_eq!(finish_chunk["choices"][0]["finish_reason"], "stop");
    assert_eq!(finish_chunk["choices"][0]["delta"], json!({}));
    let mut reasoning = String::new();
    let mut content = String::new();
    for chunk in choice_chunks {
        assert_eq!(chunk["usage"], Value::Null);
        assert_eq!(chunk["choices"].as_array().unwrap().len(), 1);
        assert_eq!(chunk["choices"][0]["index"], 0);
        assert_eq!(chunk["choices"][0]["logprobs"], Value::Null);
    }
    for chunk in &deltas[1..] {
        let choice = &chunk["choices"][0];
        assert_eq!(choice["finish_reason"], Value::Null);
        assert!(choice["delta"].get("role").is_none());
        if let Some(r) = choice["delta"]["reasoning_content"].as_str() {
            assert!(content.is_empty(), "reasoning after content: {chunk}");
            reasoning.push_str(r);
        }
        if let Some(c) = choice["delta"]["content"].as_str() {
            content.push_str(c);
        }
    }
    assert_eq!(reasoning, HELLO_REASONING);
    assert_eq!(content, HELLO_ANSWER);

    // Without include_usage there is no usage chunk.
    let chunks = post_stream(&server.base, &hello(json!({"temperature": 0, "stream": true}))).await;
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    assert!(chunks.iter().all(|c| c["usage"].is_null() && c["choices"].as_array().unwrap().len() == 1));
}

#[tokio::test]
async fn seed_makes_sampling_reproducible() {
    let server = shared();
    let ask = |seed: i64| {
        let body = json!({
            "messages": [{"role": "user", "content": "Tell me something surprising."}],
            "temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": seed, "max_tokens": 40
        });
        async move {
            let (status, resp) = post(&shared().base, &body).await;
            assert_eq!(status, StatusCode::OK, "{resp}");
            resp["choices"][0]["message"].clone()
        }
    };
    let first = ask(1234).await;
    assert_eq!(ask(1234).await, first, "the same seed gives the same text");
    let mut others = Vec::new();
    for seed in [1, 2, 3, 4, 5] {
        others.push(ask(seed).await);
    }
    assert!(others.iter().any(|m| *m != first), "different seeds should sample differently");
    let _ = server;
}

#[tokio::test]
async fn stop_strings_end_the_answer_and_are_not_returned() {
    let server = shared();
    let (status, body) = post(&server.base, &hello(json!({"temperature": 0, "stop": ["demo", "unused"]}))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["message"]["content"], "Hello! I am the Nebula");
    assert_eq!(choice["message"]["reasoning_content"], HELLO_REASONING);
    let completion = body["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((20..31).contains(&completion), "generation stopped at the stop string: {completion}");

    // A single string, streamed, matching inside the reasoning.
    let chunks = post_stream(&server.base, &hello(json!({"temperature": 0, "stop": "greets", "stream": true}))).await;
    let text: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["reasoning_content"].as_str()).collect::<String>();
    assert_eq!(text, "The user");
    assert!(chunks.iter().all(|c| c["choices"][0]["delta"].get("content").is_none_or(|c| c == "")));
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn max_tokens_ends_with_length() {
    let server = shared();
    for field in ["max_tokens", "max_completion_tokens"] {
        let (status, body) = post(&server.base, &hello(json!({"temperature": 0, field: 5}))).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["choices"][0]["finish_reason"], "length");
        assert_eq!(body["usage"]["completion_tokens"], 5);
        assert_eq!(body["choices"][0]["message"]["reasoning_content"], "The user greets me");
    }
}

#[tokio::test]
async fn thinking_off_gives_no_reasoning() {
    let server = shared();
    for extra in [json!({"chat_template_kwargs": {"enable_thinking": false}}), json!({"reasoning_effort": "none"})] {
        let mut body = hello(json!({"temperature": 0}));
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (status, resp) = post(&server.base, &body).await;
        assert_eq!(status, StatusCode::OK, "{resp}");
        let message = &resp["choices"][0]["message"];
        assert!(message.get("reasoning_content").is_none(), "{resp}");
        assert_eq!(message["content"], HELLO_ANSWER);
        body["stream"] = json!(true);
        let chunks = post_stream(&server.base, &body).await;
        assert!(chunks.iter().all(|c| c["choices"][0]["delta"].get("reasoning_content").is_none()));
    }
}

#[tokio::test]
async fn tools_are_accepted_and_rendered() {
    let server = shared();
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let body = json!({
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
            {"role": "user", "content": [{"type": "text", "text": "Hello!"}]}
        ],
        "tools": tools, "temperature": 0, "max_tokens": 64
    });
    let (status, resp) = post(&server.base, &body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    let reason = resp["choices"][0]["finish_reason"].as_str().unwrap();
    assert!(["stop", "length", "tool_calls"].contains(&reason));
    // The tools block makes the prompt much longer than the plain greeting's.
    assert!(resp["usage"]["prompt_tokens"].as_u64().unwrap() > 200, "{resp}");
}

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let server = shared();
    let hi = json!([{"role": "user", "content": "hi"}]);
    let cases: Vec<(&str, String, StatusCode, Option<&str>)> = vec![
        ("malformed JSON", "{\"messages\": [".into(), StatusCode::BAD_REQUEST, None),
        ("not an object", "[1, 2]".into(), StatusCode::BAD_REQUEST, None),
        ("empty body", String::new(), StatusCode::BAD_REQUEST, None),
        ("messages missing", json!({"model": "nebula-demo"}).to_string(), StatusCode::BAD_REQUEST, Some("messages")),
        (
            "role missing",
            json!({"messages": [{"content": "x"}]}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("messages[0].role"),
        ),
        ("messages not a list", json!({"messages": "hi"}).to_string(), StatusCode::BAD_REQUEST, Some("messages")),
        ("empty messages", json!({"messages": []}).to_string(), StatusCode::BAD_REQUEST, Some("messages")),
        (
            "content of wrong type",
            json!({"messages": [{"role": "user", "content": 5}]}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("messages[0].content"),
        ),
        (
            "unknown role",
            json!({"messages": [{"role": "wizard", "content": "x"}]}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("messages[0].role"),
        ),
        (
            "image part",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
                .to_string(),
            StatusCode::BAD_REQUEST,
            Some("messages[0].content[0]"),
        ),
        (
            "temperature as a string",
            json!({"messages": hi, "temperature": "hot"}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("temperature"),
        ),
        (
            "stream as a string",
            json!({"messages": hi, "stream": "yes"}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("stream"),
        ),
        ("unknown model", json!({"model": "gpt-4o", "messages": hi}).to_string(), StatusCode::NOT_FOUND, Some("model")),
        ("n = 9", json!({"messages": hi, "n": 9}).to_string(), StatusCode::BAD_REQUEST, Some("n")),
        ("n = 0", json!({"messages": hi, "n": 0}).to_string(), StatusCode::BAD_REQUEST, Some("n")),
        (
            "huge max_tokens",
            json!({"messages": hi, "max_tokens": 1e300}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("max_tokens"),
        ),
        (
            "max_tokens over the context",
            json!({"messages": hi, "max_tokens": 1_000_000}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("max_tokens"),
        ),
        (
            "max_completion_tokens over the context",
            json!({"messages": hi, "max_completion_tokens": 9_000_000_000_i64}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("max_completion_tokens"),
        ),
        (
            "accuracy_level 4",
            json!({"messages": hi, "accuracy_level": 4}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("accuracy_level"),
        ),
        (
            "max_context over the server's",
            json!({"messages": hi, "max_context": 1_000_000}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("max_context"),
        ),
        (
            "max_prefill 0",
            json!({"messages": hi, "max_prefill": 0}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("max_prefill"),
        ),
        (
            "presence_penalty 3",
            json!({"messages": hi, "presence_penalty": 3}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("presence_penalty"),
        ),
        (
            "repetition_penalty 0",
            json!({"messages": hi, "repetition_penalty": 0}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("repetition_penalty"),
        ),
        (
            "top_logprobs without logprobs",
            json!({"messages": hi, "top_logprobs": 3}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("top_logprobs"),
        ),
        (
            "tool_choice naming an unknown function",
            json!({"messages": hi, "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}}})
            .to_string(),
            StatusCode::BAD_REQUEST,
            Some("tool_choice"),
        ),
        (
            "tool_choice required without tools",
            json!({"messages": hi, "tool_choice": "required"}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("tool_choice"),
        ),
        (
            "json_schema without a schema object",
            json!({"messages": hi, "response_format": {"type": "json_schema", "json_schema": {"schema": 5}}})
                .to_string(),
            StatusCode::BAD_REQUEST,
            Some("response_format"),
        ),
        (
            "negative max_tokens",
            json!({"messages": hi, "max_tokens": -1}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("max_tokens"),
        ),
        (
            "zero max_completion_tokens",
            json!({"messages": hi, "max_completion_tokens": 0}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("max_completion_tokens"),
        ),
        (
            "fractional max_tokens",
            json!({"messages": hi, "max_tokens": 1.5}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("max_tokens"),
        ),
        (
            "temperature > 2",
            json!({"messages": hi, "temperature": 3}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("temperature"),
        ),
        ("top_p = 0", json!({"messages": hi, "top_p": 0}).to_string(), StatusCode::BAD_REQUEST, Some("top_p")),
        ("top_k = -2", json!({"messages": hi, "top_k": -2}).to_string(), StatusCode::BAD_REQUEST, Some("top_k")),
        ("min_p > 1", json!({"messages": hi, "min_p": 1.5}).to_string(), StatusCode::BAD_REQUEST, Some("min_p")),
        (
            "five stop strings",
            json!({"messages": hi, "stop": ["a", "b", "c", "d", "e"]}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("stop"),
        ),
        ("empty stop string", json!({"messages": hi, "stop": ""}).to_string(), StatusCode::BAD_REQUEST, Some("stop")),
        (
            "bad reasoning effort",
            json!({"messages": hi, "reasoning_effort": "ultra"}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("reasoning_effort"),
        ),
        (
            "enable_thinking not a bool",
            json!({"messages": hi, "chat_template_kwargs": {"enable_thinking": "no"}}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("chat_template_kwargs.enable_thinking"),
        ),
        (
            "top_logprobs 21",
            json!({"messages": hi, "logprobs": true, "top_logprobs": 21}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("top_logprobs"),
        ),
        (
            "unknown response_format",
            json!({"messages": hi, "response_format": {"type": "xml"}}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("response_format"),
        ),
        (
            "tool without a name",
            json!({"messages": hi, "tools": [{"type": "function", "function": {}}]}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("tools[0]"),
        ),
        (
            // A late system message is folded into the first system turn (e2e_agent_fixes); a tool message
            // without the call it answers is refused, as OpenAI refuses it.
            "tool message without tool_call_id",
            json!({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("messages[1].tool_call_id"),
        ),
        (
            "tool arguments not a JSON object",
            json!({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "",
                "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "[1"}}]},
                {"role": "user", "content": "b"}]})
            .to_string(),
            StatusCode::BAD_REQUEST,
            Some("messages"),
        ),
    ];
    for (name, body, want_status, want_param) in cases {
        let (status, resp) = post_raw(&server.base, body).await;
        println!("{name}: {status} {resp}");
        assert_error(status, &resp, want_status, want_param);
        if want_status == StatusCode::BAD_REQUEST {
            assert_eq!(resp["error"]["type"], "invalid_request_error", "{name}");
        }
    }
    let (_, resp) = post(&server.base, &json!({"model": "gpt-4o", "messages": hi})).await;
    assert_eq!(resp["error"]["code"], "model_not_found");

    // Invalid UTF-8 inside a string is a JSON syntax error.
    let (status, resp) =
        post_raw(&server.base, b"{\"messages\": [{\"role\": \"user\", \"content\": \"a\xff\"}]}".to_vec()).await;
    assert_error(status, &resp, StatusCode::BAD_REQUEST, None);
    assert_eq!(resp["error"]["code"], "invalid_json");

    // Unknown routes and wrong methods answer in the same body.
    let resp = client().get(format!("{}/v1/nothing", server.base)).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let body: Value = resp.json().await.unwrap();
    assert!(body["error"]["message"].is_string());
    let resp = client().get(format!("{}/v1/chat/completions", server.base)).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test]
async fn prompt_over_the_context_is_refused_naming_the_limit_and_model_id_overrides() {
    let server = spawn_server(ServerConfig { max_context: Some(32), model_id: Some("tiny".into()), ..test_config() });
    let models: Value = client().get(format!("{}/v1/models", server.base)).send().await.unwrap().json().await.unwrap();
    assert_eq!(models["data"][0]["max_model_len"], 32);
    assert_eq!(models["data"][0]["id"], "tiny");
    // `--model-id` replaces the GGUF's name.
    let (status, body) = post(&server.base, &hello(json!({}))).await;
    assert_error(status, &body, StatusCode::NOT_FOUND, Some("model"));
    let (status, body) = post(&server.base, &hello(json!({"model": "tiny"}))).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, Some("messages"));
    assert_eq!(body["error"]["code"], "context_length_exceeded");
    let message = body["error"]["message"].as_str().unwrap();
    let prompt_tokens = fixture()["cases"][0]["prompt_ids"].as_array().unwrap().len();
    assert!(message.contains("32 tokens"), "{message}");
    assert!(message.contains(&format!("{prompt_tokens} tokens")), "{message}");
    // Thinking off makes the prompt short enough; max_tokens is then bounded by the room left.
    let (status, body) =
        post(&server.base, &hello(json!({"model": "tiny", "reasoning_effort": "none", "temperature": 0}))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body["usage"]["total_tokens"].as_u64().unwrap() <= 32);
}

/// Waits until the engine runs nothing; returns how long that took.
async fn engine_idle_within(model: &ServedModel, limit: Duration) -> Duration {
    let t0 = Instant::now();
    while model.engine.running() + model.engine.waiting() > 0 {
        assert!(t0.elapsed() < limit, "the engine still runs the cancelled request after {limit:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    t0.elapsed()
}

async fn engine_busy(model: &ServedModel) {
    let t0 = Instant::now();
    while model.engine.running() == 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "the request never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn client_disconnect_cancels_the_generation() {
    // One sequence at a time, so that a second request waits in the queue and a third is refused.
    let batching = nebula_service::config::BatchingConfig { max_sequences: Some(1), ..Default::default() };
    let server = spawn_server(ServerConfig { queue_capacity: 1, batching, ..test_config() });
    // Without end-of-turn stops and with the whole context to fill, this runs for tens of seconds.
    let endless = hello(json!({"ignore_eos": true, "temperature": 0, "stream": true}));

    // 1. A stream dropped after a few chunks.
    let resp = client().post(format!("{}/v1/chat/completions", server.base)).json(&endless).send().await.unwrap();
    let mut body = resp.bytes_stream();
    for _ in 0..3 {
        body.next().await.unwrap().unwrap();
    }
    assert_eq!(server.model.engine.running(), 1);
    drop(body);
    let took = engine_idle_within(&server.model, Duration::from_secs(2)).await;
    println!("stream disconnect: engine idle after {took:?}");

    // 2. The queue: one runs, one waits, the next is refused with 429.
    let mut long = endless.clone();
    long["stream"] = json!(false);
    let runner = tokio::spawn(post_owned(server.base.clone(), long.clone()));
    engine_busy(&server.model).await;
    let waiter = tokio::spawn(post_owned(server.base.clone(), long.clone()));
    let t0 = Instant::now();
    while server.model.engine.waiting() == 0 {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (status, body) = post(&server.base, &long).await;
    assert_error(status, &body, StatusCode::TOO_MANY_REQUESTS, None);
    runner.abort();
    waiter.abort();
    let took = engine_idle_within(&server.model, Duration::from_secs(2)).await;
    println!("aborted non-stream requests: engine idle after {took:?}");

    // 3. A non-streamed request whose connection closes mid-generation.
    let addr = server.base.trim_start_matches("http://").to_owned();
    let mut socket = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let payload = long.to_string();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{payload}",
        payload.len()
    );
    socket.write_all(request.as_bytes()).await.unwrap();
    engine_busy(&server.model).await;
    drop(socket);
    let took = engine_idle_within(&server.model, Duration::from_secs(2)).await;
    println!("closed non-stream connection: engine idle after {took:?}");

    // The engine serves the next request normally.
    let (status, body) = post(&server.base, &hello(json!({"temperature": 0}))).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["choices"][0]["message"]["content"], HELLO_ANSWER);
}

async fn post_owned(base: String, body: Value) -> (StatusCode, Value) {
    post(&base, &body).await
}
