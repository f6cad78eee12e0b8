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
