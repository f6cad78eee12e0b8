//! Load: 64 concurrent streaming clients against the demo model, each sending a bounded number of requests
//! (and none after a deadline). Every request must either complete (200, a finish reason, `[DONE]`) or be
//! refused with 429 and `Retry-After`; the server's own success counter must equal the completions seen (nothing
//! lost), the engine must end idle, and the process's resident memory must not keep growing from the first
//! round to the last; generations overlap (batched passes of several sequences). Prints the throughput it
//! measured.

use std::time::{Duration, Instant};

use nebula_service::{ServerConfig, start};
use reqwest::StatusCode;
use serde_json::{Value, json};

const CLIENTS: usize = 64;
const ROUNDS: usize = 3;
const DEADLINE: Duration = Duration::from_secs(240);

const QUESTIONS: [&str; 6] =
    ["Hello!", "What is 2 + 2?", "Name a planet.", "Tell me a joke.", "What is a GPU?", "Count to five."];

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    completed: usize,
    refused: usize,
    tokens: usize,
}

async fn one_request(client: &reqwest::Client, base: &str, question: &str) -> Tally {
    let body = json!({"messages": [{"role": "user", "content": question}], "stream": true, "temperature": 0,
        "stream_options": {"include_usage": true}, "max_tokens": 80});
    let resp = client.post(format!("{base}/v1/chat/completions")).json(&body).send().await.unwrap();
    match resp.status() {
        StatusCode::TOO_MANY_REQUESTS => {
            assert!(resp.headers().contains_key("retry-after"));
            let err: Value = resp.json().await.unwrap();
            assert_eq!(err["error"]["type"], "rate_limit_error", "{err}");
            Tally { refused: 1, ..Tally::default() }
        }
        StatusCode::OK => {
            let text = resp.text().await.unwrap();
            let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
            assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
            let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
            assert!(chunks.iter().all(|c| c.get("error").is_none()), "{text}");
            let finish = chunks.iter().find_map(|c| c["choices"][0]["finish_reason"].as_str());
            assert!(matches!(finish, Some("stop" | "length")), "{text}");
            let usage = &chunks.last().unwrap()["usage"];
            Tally { completed: 1, tokens: usage["completion_tokens"].as_u64().unwrap() as usize, ..Tally::default() }
        }
        other => panic!("unexpected status {other}: {}", resp.text().await.unwrap()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_streaming_clients() {
    let handle = start(ServerConfig { port: 0, queue_capacity: 8, ..ServerConfig::default() }).await.unwrap();
    let model = handle.ready().await.unwrap();
    let base = handle.base_url();
    let client = reqwest::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();
    let t0 = Instant::now();
    let mut totals = Tally::default();
    let mut rss = Vec::new();
    for round in 0..ROUNDS {
        if t0.elapsed() > DEADLINE {
            break;
        }
        let tasks: Vec<_> = (0..CLIENTS)
            .map(|i| {
                let client = client.clone();
                let base = base.clone();
                tokio::spawn(async move { one_request(&client, &base, QUESTIONS[(i + round) % QUESTIONS.len()]).await })
            })
            .collect();
        for t in tasks {
            let r = t.await.unwrap();
            totals.completed += r.completed;
            totals.refused += r.refused;
            totals.tokens += r.tokens;
        }
        rss.push(rss_kib());
    }
    let seconds = t0.elapsed().as_secs_f64();
    let sent = totals.completed + totals.refused;
    println!(
        "load: {sent} requests from {CLIENTS} clients in {seconds:.1} s: {} completed, {} refused (429), \
         {} tokens, {:.1} completed requests/s, {:.1} generated tokens/s; RSS per round (KiB): {rss:?}",
        totals.completed,
        totals.refused,
        totals.tokens,
        totals.completed as f64 / seconds,
        totals.tokens as f64 / seconds,
    );
    assert!(totals.completed > 0 && totals.refused > 0, "the queue of 8 both serves and refuses: {totals:?}");

    // Nothing lost: the server counted every completion, and nothing is left running or waiting.
    let metrics = client.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    let value = |name: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.split([' ', '{']).next() == Some(name))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
            .sum()
    };
    assert_eq!(value("vllm:request_success_total") as usize, totals.completed);
    assert_eq!(value("nebula:requests_rejected_total") as usize, totals.refused);
    assert_eq!(value("vllm:generation_tokens_total") as usize, totals.tokens);
    // Generations overlapped: some passes ran several sequences.
    let single_passes: f64 = metrics
        .lines()
        .find(|l| l.starts_with("nebula:batch_size_bucket{le=\"1\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .expect("the batch-size histogram");
    let passes = value("nebula:batch_size_count");
    assert!(passes > single_passes, "no pass held more than one sequence ({passes} passes)");
    println!("load: {passes} passes, {:.0} of one sequence", single_passes);
    // The worker marks itself idle just after it sends the last event; give it a moment.
    let idle = Instant::now();
    while model.engine.running() + model.engine.waiting() > 0 {
        assert!(idle.elapsed() < Duration::from_secs(10), "the engine is still busy after every response ended");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // Memory steady: after the first round (model, caches and buffers warm), later rounds add little.
    let growth_mib = (rss.last().unwrap().saturating_sub(rss[0])) as f64 / 1024.0;
    assert!(growth_mib < 64.0, "resident memory grew by {growth_mib:.1} MiB over the rounds: {rss:?}");
    handle.shutdown();
    handle.wait().await.unwrap();
}
