//! The `nebula serve` process: a model that cannot be loaded makes it exit non-zero with a message naming the
//! file and the problem; SIGTERM stops it cleanly.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn nebula() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nebula"));
    cmd.env("RUST_LOG", "info").env_remove("NEBULA_MODEL").env_remove("NEBULA_PORT");
    cmd
}

/// Runs `nebula serve --model PATH --port 0` and returns (exit code, stderr), failing if it does not exit.
fn serve_and_exit(model: &std::path::Path) -> (Option<i32>, String) {
    let mut child = nebula()
        .args(["serve", "--port", "0", "--model"])
        .arg(model)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("nebula starts");
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut stderr = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
            return (status.code(), stderr);
        }
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("nebula serve did not exit on a bad model");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn corrupt_model_file_exits_nonzero_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("corrupt.gguf");
    std::fs::write(&path, b"GGUF\x03\x00\x00\x00 this is not a model").unwrap();
    let (code, stderr) = serve_and_exit(&path);
    assert_ne!(code, Some(0), "{stderr}");
    assert!(code.is_some(), "exited by a signal: {stderr}");
    assert!(stderr.contains(&path.display().to_string()), "the message names the file: {stderr}");
    assert!(stderr.contains("cannot load the model"), "{stderr}");
}

#[test]
fn missing_model_file_exits_nonzero_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("absent.gguf");
    let (code, stderr) = serve_and_exit(&path);
    assert_ne!(code, Some(0), "{stderr}");
    assert!(stderr.contains(&path.display().to_string()), "the message names the file: {stderr}");
}

#[cfg(unix)]
#[test]
fn sigterm_stops_the_server_cleanly() {
    let mut child = nebula()
        .args(["serve", "--port", "0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("nebula starts");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    loop {
        let line = lines.next().expect("nebula logs until the model is loaded").unwrap();
        let loaded = line.contains("model loaded");
        seen.push(line);
        if loaded {
            break;
        }
    }
    let pid = child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let t0 = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "nebula ignored SIGTERM: {seen:?}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "exit status {status:?}: {seen:?}");
}

/// SIGTERM during a stream: the server stops accepting, lets the open stream finish (`[DONE]`), then exits 0.
#[cfg(unix)]
#[test]
fn sigterm_drains_an_open_stream() {
    use std::io::{Read, Write};
    let mut child = nebula()
        .args(["serve", "--port", "0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("nebula starts");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut addr = None;
    loop {
        let line = lines.next().expect("nebula logs until the model is loaded").unwrap();
        if let Some(rest) = line.split("addr=").nth(1) {
            addr = rest.split_whitespace().next().map(str::to_owned);
        }
        if line.contains("model loaded") {
            break;
        }
    }
    // Keep draining stderr so the server never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    let addr = addr.expect("the listening address is logged");
    wait_ready(&addr);
    let body = r#"{"messages": [{"role": "user", "content": "Hello!"}], "stream": true, "ignore_eos": true, "max_tokens": 300, "temperature": 0}"#;
    let mut socket = std::net::TcpStream::connect(&addr).unwrap();
    write!(
        socket,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 256];
    let n = socket.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"), "the stream began");
    let pid = child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let mut rest = String::new();
    socket.read_to_string(&mut rest).unwrap();
    assert!(rest.contains("data: [DONE]"), "the open stream finished: {rest}");
    assert!(rest.contains("\"finish_reason\":\"length\""), "it ran to max_tokens");
    let t0 = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "nebula did not exit after draining");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "exit status {status:?}");
}

/// With `--otlp-endpoint`, a request's spans (request, generation, queue, prefill, decode) reach an OTLP/HTTP
/// collector (a loopback stub that stores what it is sent); they are flushed at shutdown at the latest.
#[cfg(unix)]
#[test]
fn traces_reach_an_otlp_collector() {
    use std::io::{Read, Write};
    use std::sync::{Arc, Mutex};
    let collector = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}/v1/traces", collector.local_addr().unwrap());
    let received: Arc<Mutex<Vec<u8>>> = Arc::default();
    {
        let received = received.clone();
        std::thread::spawn(move || {
            for stream in collector.incoming() {
                let Ok(mut stream) = stream else { continue };
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut length = 0usize;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 {
                        break;
                    }
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap_or(0);
                    }
                    if line == "\r\n" {
                        let mut body = vec![0u8; length];
                        if reader.read_exact(&mut body).is_ok() {
                            received.lock().unwrap().extend_from_slice(&body);
                        }
                        let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
                        length = 0;
                    }
                }
            }
        });
    }
    let mut child = nebula()
        .args(["serve", "--port", "0", "--otlp-endpoint", &endpoint])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("nebula starts");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut addr = None;
    loop {
        let line = lines.next().expect("nebula logs until the model is loaded").unwrap();
        if let Some(rest) = line.split("addr=").nth(1) {
            addr = rest.split_whitespace().next().map(str::to_owned);
        }
        if line.contains("model loaded") {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    let addr = addr.expect("the listening address is logged");
    wait_ready(&addr);
    let body = r#"{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 5}"#;
    let mut socket = std::net::TcpStream::connect(&addr).unwrap();
    write!(
        socket,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    socket.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    let pid = child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        assert!(t0.elapsed() < Duration::from_secs(60), "nebula did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
    let bytes = received.lock().unwrap().clone();
    let has = |s: &str| bytes.windows(s.len()).any(|w| w == s.as_bytes());
    for span in ["request", "generation", "queue", "prefill", "decode", "nebula"] {
        assert!(has(span), "span or service name {span:?} not exported ({} bytes received)", bytes.len());
    }
}

/// Polls `GET /health` until it answers 200 (the model is served).
fn wait_ready(addr: &str) {
    use std::io::{Read, Write};
    let t0 = Instant::now();
    loop {
        let mut socket = std::net::TcpStream::connect(addr).unwrap();
        write!(socket, "GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
        let mut response = String::new();
        socket.read_to_string(&mut response).unwrap();
        if response.starts_with("HTTP/1.1 200") {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "never ready: {response}");
        std::thread::sleep(Duration::from_millis(10));
    }
}
