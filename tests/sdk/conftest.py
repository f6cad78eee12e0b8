"""Starts `nebula serve` on free loopback ports with the embedded demo model for the SDK tests: `server` with the
default settings, `strict_server` with an API key, a 64 KiB body limit and one request at a time (no waiting), for
the 401, 413 and 429 cases, `agent_server` with an API key and `serve_any_model` (coding agents send their own
model names), `alias_server` with `model_aliases`.

The binary is `$NEBULA_BIN` if set, else `target/release/nebula` (scripts/test_sdk.sh builds it).
"""

import json
import os
import pathlib
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(base: str):
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)
    except OSError:
        return None, None


STRICT_KEY = "sdk-test-key"


def _run_server(name: str, extra_env: dict):
    binary = pathlib.Path(os.environ.get("NEBULA_BIN", REPO / "target" / "release" / "nebula"))
    if not binary.exists():
        pytest.fail(f"{binary} does not exist: build it (cargo build --release -p nebula-service) or set NEBULA_BIN")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEBULA_")}
    env.setdefault("RUST_LOG", "info")
    env.update(extra_env)
    log = open(REPO / "target" / f"sdk-test-{name}.log", "w")
    proc = subprocess.Popen([str(binary), "serve", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        seen = []
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"nebula serve exited with {proc.returncode}; see target/sdk-test-{name}.log")
            status, body = _health(base)
            if status is not None:
                seen.append((status, body))
            if status == 200:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"nebula serve was not ready after 120 s: {seen[-3:]}")
            time.sleep(0.05)
        # Every answer before readiness was the loading answer, with its phase.
        for status, body in seen[:-1]:
            assert status == 503 and body["status"] == "loading" and body["phase"], seen
        assert seen[-1] == (200, {"status": "ok"})
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    assert proc.returncode == 0, f"nebula serve exited with {proc.returncode} on SIGTERM"


@pytest.fixture(scope="session")
def server():
    """Yields the base URL (`http://127.0.0.1:PORT`) of a running, ready server; stops it afterwards."""
    yield from _run_server("server", {})


@pytest.fixture(scope="session")
def strict_server():
    """A server with API key `STRICT_KEY`, a 64 KiB body limit and a single request slot with no queue."""
    yield from _run_server(
        "strict-server",
        {
            "NEBULA_API_KEY": STRICT_KEY,
            "NEBULA_BODY_LIMIT_BYTES": "65536",
            "NEBULA_MAX_CONCURRENT_REQUESTS": "1",
            "NEBULA_MAX_WAITING_REQUESTS": "0",
        },
    )


AGENT_KEY = "agent-test-key"
ALIASES = ["claude-opus-4-1-20250805", "gpt-5-codex"]


@pytest.fixture(scope="session")
def agent_server():
    """A server as coding agents meet it: API key `AGENT_KEY` (Bearer or x-api-key) and `serve_any_model`, so
    that the agents' own model names are answered. Its context (2560 tokens) bounds how long the demo model may
    write on the agents' unfamiliar prompts."""
    yield from _run_server(
        "agent-server", {"NEBULA_API_KEY": AGENT_KEY, "NEBULA_SERVE_ANY_MODEL": "true", "NEBULA_MAX_CONTEXT": "2560"}
    )


@pytest.fixture(scope="session")
def alias_server():
    """A server answering to the model names in `ALIASES` besides its own id (and to no others)."""
    yield from _run_server("alias-server", {"NEBULA_MODEL_ALIASES": json.dumps(ALIASES)})
