//! The agent-facing endpoints over real HTTP (`nebula serve` in process on an ephemeral port with the embedded demo
//! model): bad input on `POST /v1/responses`, `POST /v1/messages`, `POST /v1/messages/count_tokens`,
//! `POST /tokenize` and `POST /detokenize` gets a clear 400/404/405 in each API's own error shape (OpenAI's
//! `{"error": {...}}`, Anthropic's `{"type": "error", "error": {...}}`), never a panic or a hang; tokenize and
//! detokenize round-trip; model aliases and `x-api-key`. The SDK-level behaviour is tested in tests/sdk.

use std::sync::OnceLock;
use std::time::Duration;

use nebula_service::ServerConfig;
use reqwest::StatusCode;
use serde_json::{Value, json};

/// The context limit of the test server: small, so that an over-context prompt is cheap to write.
const CONTEXT: usize = 512;
const KEY: &str = "e2e-agent-key";

/// A server with `config`: its base URL.
fn spawn(config: ServerConfig) -> String {
    nebula_tests::spawn_server(config).0
}

fn base() -> &'static str {
    static BASE: OnceLock<String> = OnceLock::new();
    BASE.get_or_init(|| {
        spawn(ServerConfig {
            port: 0,
            max_context: Some(CONTEXT),
            model_aliases: vec!["claude-test-alias".into()],
            ..ServerConfig::default()
        })
    })
}

async fn post_raw(path: &str, body: impl Into<reqwest::Body>) -> (StatusCode, Value) {
    let resp = reqwest::Client::new()
        .post(format!("{}{path}", base()))
        .header("content-type", "application/json")
        .timeout(Duration::from_secs(120))
        .body(body)
        .send()
        .await
        .unwrap();
    let status = resp.status();
    let text = resp.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}")))
}

async fn post(path: &str, body: &Value) -> (StatusCode, Value) {
    post_raw(path, body.to_string()).await
}

/// An OpenAI error with `status` and, when given, `param`.
fn openai_error(got: &(StatusCode, Value), status: StatusCode, param: Option<&str>, case: &str) {
    assert_eq!(got.0, status, "{case}: {}", got.1);
    let error = &got.1["error"];
    assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()), "{case}: {}", got.1);
    assert!(error["type"].is_string(), "{case}: {}", got.1);
    if let Some(param) = param {
        assert_eq!(error["param"], param, "{case}: {}", got.1);
    }
}

/// An Anthropic error with `status` and error type `kind`; returns the message.
fn anthropic_error(got: &(StatusCode, Value), status: u16, kind: &str, case: &str) -> String {
    assert_eq!(got.0.as_u16(), status, "{case}: {}", got.1);
    assert_eq!(got.1["type"], "error", "{case}: {}", got.1);
    assert_eq!(got.1["error"]["type"], kind, "{case}: {}", got.1);
    assert_eq!(got.1.as_object().unwrap().len(), 2, "{case}: only `type` and `error`: {}", got.1);
    got.1["error"]["message"].as_str().unwrap_or_default().to_owned()
}

fn long_text() -> String {
    "the quick brown fox jumps over the lazy dog ".repeat(CONTEXT / 4)
}

#[tokio::test]
async fn responses_bad_input_gets_openai_errors() {
    let bad = StatusCode::BAD_REQUEST;
    for (body, param, case) in [
        (json!({"input": 5}), Some("input"), "input of the wrong type"),
        (json!({}), Some("input"), "no input"),
        (json!({"input": []}), Some("input"), "empty input"),
        (json!({"input": "hi", "bogus": true}), None, "an unknown field"),
        (json!({"input": "hi", "temperature": "hot"}), Some("temperature"), "temperature of the wrong type"),
        (json!({"input": "hi", "temperature": 9}), Some("temperature"), "temperature out of range"),
        (json!({"input": "hi", "max_output_tokens": 0}), Some("max_output_tokens"), "no output tokens"),
        (json!({"input": "hi", "previous_response_id": "resp_1"}), Some("previous_response_id"), "stored state"),
        (json!({"input": "hi", "background": true}), Some("background"), "background"),
        (json!({"input": [{"type": "item_reference", "id": "x"}]}), Some("input[0].type"), "item reference"),
        (json!({"input": [{"role": "critic", "content": "x"}]}), Some("input[0].role"), "unknown role"),
        (json!({"input": [7]}), Some("input[0]"), "an item that is no object"),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}),
            Some("input[0].content[0]"),
            "an image that is not one",
        ),
        (json!({"input": [{"type": "function_call", "name": "f"}]}), Some("input[0].call_id"), "call without id"),
        (json!({"input": "hi", "tools": [{"name": "f"}]}), Some("tools[0].type"), "a tool without a type"),
        (json!({"input": "hi", "tool_choice": 3}), Some("tool_choice"), "bad tool_choice"),
        (json!({"input": "hi", "text": {"format": {"type": "xml"}}}), Some("text.format.type"), "bad format"),
        (json!({"input": "hi", "reasoning": {"effort": "huge"}}), Some("reasoning_effort"), "bad effort"),
    ] {
        openai_error(&post("/v1/responses", &body).await, bad, param, case);
    }
    for raw in ["{", "", "[1]", "{\"input\": \"hi\"} x"] {
        openai_error(&post_raw("/v1/responses", raw).await, bad, None, raw);
    }
    // Over the context: a 400 that names the limit, streamed or not.
    for stream in [false, true] {
        let got = post("/v1/responses", &json!({"input": long_text(), "stream": stream})).await;
        openai_error(&got, bad, None, "over the context");
        assert!(got.1["error"]["message"].as_str().unwrap().contains(&CONTEXT.to_string()), "{}", got.1);
        assert_eq!(got.1["error"]["code"], "context_length_exceeded");
    }
    let got = post("/v1/responses", &json!({"input": "hi", "max_output_tokens": CONTEXT * 2})).await;
    openai_error(&got, bad, Some("max_output_tokens"), "budget over the context");
    // Unknown model: 404 in the OpenAI shape, also for a stream.
    for stream in [false, true] {
        let got = post("/v1/responses", &json!({"model": "gpt-5-codex", "input": "hi", "stream": stream})).await;
        openai_error(&got, StatusCode::NOT_FOUND, Some("model"), "unknown model");
        assert_eq!(got.1["error"]["code"], "model_not_found");
    }
    // An alias is answered (a one-token budget keeps it short).
    let got =
        post("/v1/responses", &json!({"model": "claude-test-alias", "input": "Hello!", "max_output_tokens": 1})).await;
    assert_eq!(got.0, StatusCode::OK, "{}", got.1);
    assert_eq!(got.1["model"], "claude-test-alias");
    assert_eq!(got.1["status"], "incomplete");
}

#[tokio::test]
async fn messages_bad_input_gets_anthropic_errors() {
    let ok = |extra: Value| {
        let mut body =
            json!({"model": "nebula-demo", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let message = anthropic_error(
        &post("/v1/messages", &json!({"model": "nebula-demo", "messages": [{"role": "user", "content": "hi"}]})).await,
        400,
        "invalid_request_error",
        "missing max_tokens",
    );
    assert!(message.contains("max_tokens"), "{message}");
    for (body, case) in [
        (ok(json!({"bogus": 1})), "an unknown field"),
        (ok(json!({"messages": "hi"})), "messages of the wrong type"),
        (ok(json!({"messages": []})), "no messages"),
        (ok(json!({"max_tokens": 0})), "no output tokens"),
        (ok(json!({"max_tokens": "many"})), "max_tokens of the wrong type"),
        (ok(json!({"temperature": 7})), "temperature out of range"),
        (ok(json!({"messages": [{"role": "critic", "content": "x"}]})), "unknown role"),
        (
            ok(json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]})),
            "an image without a source type",
        ),
        (ok(json!({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]})), "a document"),
        (ok(json!({"messages": [{"role": "user", "content": [{"type": "hologram"}]}]})), "unknown block"),
        (ok(json!({"messages": [{"role": "user", "content": [{"text": "x"}]}]})), "block without type"),
        (ok(json!({"messages": [{"role": "user", "content": 3}]})), "content of the wrong type"),
        (ok(json!({"tools": [{"name": "f"}]})), "a tool without input_schema"),
        (ok(json!({"tool_choice": {"type": "sometimes"}})), "bad tool_choice"),
        (ok(json!({"thinking": {"type": "maybe"}})), "bad thinking"),
        (ok(json!({"output_config": {"effort": "extreme"}})), "bad effort"),
        (ok(json!({"stop_sequences": [""]})), "an empty stop sequence"),
        (ok(json!({"mcp_servers": [{"url": "http://x"}]})), "MCP servers"),
    ] {
        anthropic_error(&post("/v1/messages", &body).await, 400, "invalid_request_error", case);
    }
    let image = ok(json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}));
    let message = anthropic_error(&post("/v1/messages", &image).await, 400, "invalid_request_error", "image");
    assert!(message.contains("`source` with a `type`"), "{message}");
    let document = ok(json!({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}));
    let message = anthropic_error(&post("/v1/messages", &document).await, 400, "invalid_request_error", "document");
    assert!(message.contains("text only"), "{message}");
    for raw in ["{", "", "[1]", "{} x"] {
        anthropic_error(&post_raw("/v1/messages", raw).await, 400, "invalid_request_error", raw);
    }
    // Over the context: a 400 naming the limit.
    for stream in [false, true] {
        let body = ok(json!({"messages": [{"role": "user", "content": long_text()}], "stream": stream}));
        let message = anthropic_error(&post("/v1/messages", &body).await, 400, "invalid_request_error", "long");
        assert!(message.contains(&CONTEXT.to_string()), "{message}");
    }
    // Unknown model: 404 not_found_error; an alias is answered; max_tokens over the context is clamped.
    for stream in [false, true] {
        let got = post("/v1/messages", &ok(json!({"model": "claude-opus-9", "stream": stream}))).await;
        anthropic_error(&got, 404, "not_found_error", "unknown model");
    }
    let got = post("/v1/messages", &ok(json!({"model": "claude-test-alias", "max_tokens": 1}))).await;
    assert_eq!(got.0, StatusCode::OK, "{}", got.1);
    assert_eq!(
        (got.1["model"].as_str(), got.1["stop_reason"].as_str()),
        (Some("claude-test-alias"), Some("max_tokens"))
    );
    let got =
        post("/v1/messages?beta=true", &ok(json!({"max_tokens": 100_000_000, "thinking": {"type": "disabled"}}))).await;
    assert_eq!(got.0, StatusCode::OK, "{}", got.1);
    assert!(got.1["usage"]["output_tokens"].as_u64().unwrap() < CONTEXT as u64);
    // Other methods and sub-paths in the Anthropic shape too.
    let resp = reqwest::get(format!("{}/v1/messages", base())).await.unwrap();
    let got = (resp.status(), resp.json::<Value>().await.unwrap());
    anthropic_error(&got, 405, "invalid_request_error", "GET");
    let got = post("/v1/messages/batches", &json!({})).await;
    anthropic_error(&got, 404, "not_found_error", "batches");
    // count_tokens.
    let got = post("/v1/messages/count_tokens", &json!({"messages": [{"role": "user", "content": "hi"}]})).await;
    let message = anthropic_error(&got, 400, "invalid_request_error", "count without model");
    assert!(message.contains("model"), "{message}");
    let got =
        post("/v1/messages/count_tokens", &json!({"model": "nebula-demo", "messages": [], "max_tokens": 5})).await;
    anthropic_error(&got, 400, "invalid_request_error", "count with max_tokens (unknown there)");
    let got =
        post("/v1/messages/count_tokens", &json!({"model": "x", "messages": [{"role": "user", "content": "hi"}]}))
            .await;
    anthropic_error(&got, 404, "not_found_error", "count of an unknown model");
    let got = post(
        "/v1/messages/count_tokens",
        &json!({"model": "nebula-demo", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(got.0, StatusCode::OK);
    assert!(got.1["input_tokens"].as_u64().unwrap() > 0);
}

#[tokio::test]
async fn tokenize_and_detokenize_round_trip_and_refuse_bad_input() {
    let (status, got) = post("/tokenize", &json!({"content": "Hello world", "with_pieces": true})).await;
    assert_eq!(status, StatusCode::OK, "{got}");
    let pieces: String = got["tokens"].as_array().unwrap().iter().map(|t| t["piece"].as_str().unwrap()).collect();
    assert_eq!(pieces, "Hello world");
    let ids: Vec<u64> = got["tokens"].as_array().unwrap().iter().map(|t| t["id"].as_u64().unwrap()).collect();
    assert_eq!(got["count"], ids.len());
    let (_, plain) = post("/tokenize", &json!({"prompt": "Hello world", "return_token_strs": true})).await;
    assert_eq!(plain["tokens"], json!(ids));
    assert_eq!(plain["token_strs"].as_array().unwrap().len(), ids.len());
    let (status, text) = post("/detokenize", &json!({"tokens": ids})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!((text["content"].as_str(), text["prompt"].as_str()), (Some("Hello world"), Some("Hello world")));
    // Special tokens: recognised by default, plain text with parse_special: false.
    let (_, special) = post("/tokenize", &json!({"content": "<|im_end|>"})).await;
    let (_, literal) = post("/tokenize", &json!({"content": "<|im_end|>", "parse_special": false})).await;
    assert_eq!(special["count"], 1);
    assert!(literal["count"].as_u64().unwrap() > 1);
    // A conversation: rendered with the template.
    let (status, chat) = post("/tokenize", &json!({"messages": [{"role": "user", "content": "Hello!"}]})).await;
    assert_eq!(status, StatusCode::OK, "{chat}");
    let (_, rendered) = post("/detokenize", &json!({"tokens": chat["tokens"]})).await;
    assert!(rendered["content"].as_str().unwrap().contains("<|im_start|>user\nHello!<|im_end|>"), "{rendered}");

    let bad = StatusCode::BAD_REQUEST;
    for (path, body, param) in [
        ("/tokenize", json!({}), Some("content")),
        ("/tokenize", json!({"content": "a", "prompt": "b"}), Some("content")),
        ("/tokenize", json!({"content": 5}), Some("content")),
        ("/tokenize", json!({"content": "a", "bogus": 1}), None),
        ("/tokenize", json!({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": false}), None),
        ("/detokenize", json!({"tokens": [4_000_000_000u64]}), Some("tokens")),
        ("/detokenize", json!({"tokens": [-1]}), Some("tokens[0]")),
        ("/detokenize", json!({"tokens": "abc"}), Some("tokens")),
        ("/detokenize", json!({}), Some("tokens")),
    ] {
        openai_error(&post(path, &body).await, bad, param, &body.to_string());
    }
    openai_error(&post_raw("/tokenize", "{").await, bad, None, "malformed");
    let got = post("/tokenize", &json!({"content": "a", "model": "nope"})).await;
    openai_error(&got, StatusCode::NOT_FOUND, Some("model"), "unknown model");
}

#[tokio::test]
async fn the_api_key_is_read_from_x_api_key_too() {
    let base = spawn(ServerConfig { port: 0, api_key: Some(KEY.into()), ..ServerConfig::default() });
    let client = reqwest::Client::new();
    let body = json!({"model": "nebula-demo", "messages": [{"role": "user", "content": "hi"}]});
    let count = |key: Option<(&'static str, String)>| {
        let mut req = client.post(format!("{base}/v1/messages/count_tokens")).json(&body);
        if let Some((name, value)) = key {
            req = req.header(name, value);
        }
        req.send()
    };
    assert_eq!(count(Some(("x-api-key", KEY.into()))).await.unwrap().status(), StatusCode::OK);
    assert_eq!(count(Some(("authorization", format!("Bearer {KEY}")))).await.unwrap().status(), StatusCode::OK);
    for key in [None, Some(("x-api-key", "wrong".to_owned()))] {
        let resp = count(key).await.unwrap();
        let got = (resp.status(), resp.json::<Value>().await.unwrap());
        let message = anthropic_error(&got, 401, "authentication_error", "no or a wrong key");
        assert!(message.contains("x-api-key"), "{message}");
    }
    // The OpenAI routes take it too, and refuse in their own shape.
    let resp = client
        .post(format!("{base}/v1/responses"))
        .header("x-api-key", "wrong")
        .json(&json!({"input": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(resp.json::<Value>().await.unwrap()["error"]["code"], "invalid_api_key");
}
