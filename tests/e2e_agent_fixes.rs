//! Defects agent clients found, end to end over real HTTP with the embedded demo model: message roles (OpenAI's
//! `developer`, several or late system messages, required fields), `reasoning_effort` with thinking off, the
//! server's default output cap, forced tool calls bounded by `maxLength` and cut off honestly, long bodies that
//! must not hold up other requests, and streams open when the shutdown grace period ends (a real `nebula serve`
//! process and SIGTERM).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use nebula_service::ServerConfig;
use reqwest::StatusCode;
use serde_json::{Value, json};

use nebula_tests::spawn_server;

fn config() -> ServerConfig {
    ServerConfig { port: 0, ..ServerConfig::default() }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(300)).build().unwrap()
}

async fn post(base: &str, body: &Value) -> (StatusCode, Value) {
    let resp = client().post(format!("{base}/v1/chat/completions")).json(body).send().await.unwrap();
    let status = resp.status();
    let text = resp.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}")))
}

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

#[tokio::test]
async fn roles_as_openai_clients_send_them() {
    let (base, _) = spawn_server(config());
    let ask = |messages: Value| json!({"messages": messages, "max_tokens": 1, "temperature": 0});
    let prompt_tokens = |body: &Value| body["usage"]["prompt_tokens"].as_u64().unwrap();

    // `developer` is `system` under its newer name: the same prompt.
    let (status, dev) = post(&base, &ask(json!([{"role": "developer", "content": "Be brief."}, user("Hi")]))).await;
    assert_eq!(status, StatusCode::OK, "{dev}");
    let (_, sys) = post(&base, &ask(json!([{"role": "system", "content": "Be brief."}, user("Hi")]))).await;
    assert_eq!(prompt_tokens(&dev), prompt_tokens(&sys));

    // Two leading system messages, and one late (pydantic-ai's retry), fold into the first system turn in order.
    let folded = ask(json!([{"role": "system", "content": "Be brief.\n\nUse JSON."}, user("Hi")]));
    let (_, folded) = post(&base, &folded).await;
    let two = ask(
        json!([{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use JSON."}, user("Hi")]),
    );
    let (status, two) = post(&base, &two).await;
    assert_eq!(status, StatusCode::OK, "{two}");
    assert_eq!(prompt_tokens(&two), prompt_tokens(&folded));
    let late = ask(
        json!([{"role": "system", "content": "Be brief."}, user("Hi"), {"role": "developer", "content": "Use JSON."}]),
    );
    let (status, late) = post(&base, &late).await;
    assert_eq!(status, StatusCode::OK, "{late}");
    assert_eq!(prompt_tokens(&late), prompt_tokens(&folded));

    // What OpenAI requires, refused as OpenAI refuses it.
    let call = json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]});
    let (status, err) = post(&base, &ask(json!([user("Hi"), call, {"role": "tool", "content": "42"}]))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{err}");
    assert_eq!(err["error"]["param"], "messages[2].tool_call_id");
    assert_eq!(err["error"]["message"], "Missing required parameter: 'messages[2].tool_call_id'.");
    let (status, err) = post(&base, &ask(json!([{"role": "user"}]))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{err}");
    assert_eq!(err["error"]["param"], "messages[0].content");
}

#[tokio::test]
async fn reasoning_effort_is_checked_only_when_thinking() {
    let (base, _) = spawn_server(config());
    let body = |thinking: bool| {
        json!({"messages": [user("Hi")], "max_tokens": 1, "reasoning_effort": "extreme",
               "chat_template_kwargs": {"enable_thinking": thinking}})
    };
    let (status, off) = post(&base, &body(false)).await;
    assert_eq!(status, StatusCode::OK, "thinking off ignores the effort, as the template does: {off}");
    let (status, on) = post(&base, &body(true)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{on}");
    assert_eq!(on["error"]["param"], "reasoning_effort");
}

#[tokio::test]
async fn requests_without_max_tokens_get_the_default_cap() {
    let mut config = config();
    config.defaults.default_max_tokens = 7;
    let (base, _) = spawn_server(config);
    let (status, body) = post(&base, &json!({"messages": [user("Hi")], "ignore_eos": true})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 7);
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    // A request's own budget wins over the default.
    let (_, body) = post(&base, &json!({"messages": [user("Hi")], "ignore_eos": true, "max_tokens": 9})).await;
    assert_eq!(body["usage"]["completion_tokens"], 9);
}

fn city_tool(max_length: Option<u64>) -> Value {
    let mut city = json!({"type": "string"});
    if let Some(n) = max_length {
        city["maxLength"] = json!(n);
    }
    json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": city}, "required": ["city"]}}}])
}

#[tokio::test]
async fn forced_calls_respect_max_length_and_are_cut_off_honestly() {
    let (base, _) = spawn_server(config());
    let forced = |tools: Value, max_tokens: u64| {
        json!({"messages": [user("Weather in Paris?")], "tools": tools, "temperature": 0, "max_tokens": max_tokens,
               "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
               "chat_template_kwargs": {"enable_thinking": false}})
    };
    // `maxLength` bounds the raw string value: the call completes within it.
    let (status, body) = post(&base, &forced(city_tool(Some(6)), 400)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{body}");
    let arguments: Value =
        serde_json::from_str(choice["message"]["tool_calls"][0]["function"]["arguments"].as_str().unwrap())
            .expect("complete arguments parse");
    assert!(arguments["city"].as_str().unwrap().chars().count() <= 6, "{arguments}");

    // Without a bound, a budget that ends inside the value: `length`, and the arguments as written (an open
    // object), never a made-up `{}`; streamed and not alike.
    let cut = forced(city_tool(None), 24);
    let (status, body) = post(&base, &cut).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "length", "{body}");
    let arguments = choice["message"]["tool_calls"][0]["function"]["arguments"].as_str().unwrap().to_owned();
    assert!(arguments.starts_with("{\"city\": \""), "{arguments}");
    assert!(serde_json::from_str::<Value>(&arguments).is_err(), "a cut-off call is not complete: {arguments}");

    let mut stream = cut.clone();
    stream["stream"] = json!(true);
    let text =
        client().post(format!("{base}/v1/chat/completions")).json(&stream).send().await.unwrap().text().await.unwrap();
    let chunks: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"].as_str())
        .collect();
    assert_eq!(streamed, arguments);
    let finish = chunks.iter().find_map(|c| c["choices"][0]["finish_reason"].as_str()).unwrap();
    assert_eq!(finish, "length");
}

/// Long bodies are rendered and encoded off the async runtime: a small request sent after four long ones is
/// answered before any of them (on a two-worker runtime, encoding on the workers made it wait for them). The
/// long bodies are just under the size that is refused unread, so each is encoded, then refused as too long.
#[tokio::test]
async fn a_small_request_is_not_held_up_by_long_bodies() {
    let (base, model) = spawn_server(config());
    let context = model.engine.max_context();
    let per_token = nebula_service::chat::NFC_MAX_SHRINK * model.engine.tokenizer().max_token_bytes();
    let bytes = per_token * context - 64;
    let words = ["alpha ", "beta ", "gamma ", "delta ", "nebula ", "7 ", "Zürich ", "🙂 "];
    let mut long = String::with_capacity(bytes + 16);
    let mut i = 0usize;
    while long.len() < bytes - 16 {
        long.push_str(words[i % words.len()]);
        i = i.wrapping_mul(31).wrapping_add(7);
    }
    let finished: Arc<Mutex<Vec<&'static str>>> = Arc::default();
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (base, body, finished) =
            (base.clone(), json!({"messages": [user(&long)], "max_tokens": 1}), finished.clone());
        tasks.push(tokio::spawn(async move {
            let (status, body) = post(&base, &body).await;
            finished.lock().unwrap().push("long");
            (status, body)
        }));
    }
    // Let the long requests arrive first (pacing only; the assertion is on order).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (status, small) = post(&base, &json!({"messages": [user("Hi")], "max_tokens": 1})).await;
    finished.lock().unwrap().push("small");
    assert_eq!(status, StatusCode::OK, "{small}");
    for task in tasks {
        let (status, body) = task.await.unwrap();
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(body["error"]["code"], "context_length_exceeded");
    }
    assert_eq!(finished.lock().unwrap()[0], "small", "{:?}", finished.lock().unwrap());
}

/// A body whose byte count alone proves it too long for the context is refused before it is encoded.
#[tokio::test]
async fn a_body_too_long_by_its_size_is_refused_unread() {
    let (base, model) = spawn_server(config());
    let per_token = nebula_service::chat::NFC_MAX_SHRINK * model.engine.tokenizer().max_token_bytes();
    let long = "a".repeat(per_token * model.engine.max_context());
    let (status, body) = post(&base, &json!({"messages": [user(&long)]})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["code"], "context_length_exceeded");
    assert!(body["error"]["message"].as_str().unwrap().contains("at least"), "{body}");
    let (status, body) = post_completion(&base, &json!({"prompt": long})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("at least"), "{body}");
}

async fn post_completion(base: &str, body: &Value) -> (StatusCode, Value) {
    let resp = client().post(format!("{base}/v1/completions")).json(body).send().await.unwrap();
    let status = resp.status();
    (status, resp.json().await.unwrap())
}

/// The `nebula` binary `cargo build --release` made (or `NEBULA_BIN`).
fn nebula_bin() -> std::path::PathBuf {
    let path = std::env::var("NEBULA_BIN")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| nebula_tests::repo_root().join("target/release/nebula"));
    assert!(path.exists(), "{} is missing: run `cargo build --release -p nebula-service` first", path.display());
    path
}

/// SIGTERM with streams still open past the grace period: each stream ends with an error event, then
/// `[DONE]`; a request still waiting gets a clean 503; the process exits 0.
#[tokio::test]
async fn streams_open_past_the_shutdown_grace_end_with_an_error_and_done() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut child = std::process::Command::new(nebula_bin())
        .arg("serve")
        .env("NEBULA_HOST", "127.0.0.1")
        .env("NEBULA_PORT", port.to_string())
        .env("NEBULA_SHUTDOWN_GRACE_S", "1")
        .env("NEBULA_MAX_CONCURRENT_REQUESTS", "2")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("nebula serve starts");
    let base = format!("http://127.0.0.1:{port}");
    let mut ready = false;
    for _ in 0..600 {
        if let Ok(r) = client().get(format!("{base}/health")).send().await
            && r.status() == StatusCode::OK
        {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ready, "the server became healthy");
    let models: Value = client().get(format!("{base}/v1/models")).send().await.unwrap().json().await.unwrap();
    let room = models["data"][0]["max_model_len"].as_u64().unwrap() - 64;
    let long = json!({"messages": [user("Hi")], "stream": true, "ignore_eos": true, "max_tokens": room});

    // Two streams take the two slots; a third request waits for one.
    let mut streams = Vec::new();
    for _ in 0..2 {
        let resp = client().post(format!("{base}/v1/chat/completions")).json(&long).send().await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        streams.push(resp.bytes_stream());
    }
    // The first stream is generating: wait for its first content.
    let mut first = String::new();
    while !first.contains("\"content\"") {
        first.push_str(&String::from_utf8_lossy(&streams[0].next().await.unwrap().unwrap()));
    }
    let waiting = tokio::spawn({
        let base = base.clone();
        async move {
            client()
                .post(format!("{base}/v1/chat/completions"))
                .json(&json!({"messages": [user("Hi")], "max_tokens": 1}))
                .send()
                .await
                .map(|r| r.status())
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let killed = std::process::Command::new("kill").arg("-TERM").arg(child.id().to_string()).status().unwrap();
    assert!(killed.success());

    for (i, mut stream) in streams.into_iter().enumerate() {
        let mut text = if i == 0 { std::mem::take(&mut first) } else { String::new() };
        while let Some(frame) = stream.next().await {
            text.push_str(&String::from_utf8_lossy(&frame.expect("the stream is not cut")));
        }
        let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
        assert_eq!(
            data.last(),
            Some(&"[DONE]"),
            "stream {i} ends with [DONE]: {}",
            &text[text.len().saturating_sub(400)..]
        );
        let error: Value = serde_json::from_str(data[data.len() - 2]).unwrap();
        assert_eq!(error["error"]["type"], "server_error", "stream {i}: {error}");
        assert!(error["error"]["message"].as_str().unwrap().contains("shutting down"), "stream {i}: {error}");
    }
    match waiting.await.unwrap() {
        Ok(status) => assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE),
        Err(e) => panic!("the waiting request got no answer: {e}"),
    }
    let status = child.wait().unwrap();
    assert!(status.success(), "nebula serve exits cleanly: {status}");
}
