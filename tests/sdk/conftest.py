"""Starts `nebula serve` on a free loopback port with the embedded demo model for the SDK tests.

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


@pytest.fixture(scope="session")
def server():
    """Yields the base URL (`http://127.0.0.1:PORT`) of a running, ready server; stops it afterwards."""
    binary = pathlib.Path(os.environ.get("NEBULA_BIN", REPO / "target" / "release" / "nebula"))
    if not binary.exists():
        pytest.fail(f"{binary} does not exist: build it (cargo build --release -p nebula-service) or set NEBULA_BIN")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEBULA_")}
    env.setdefault("RUST_LOG", "info")
    log = open(REPO / "target" / "sdk-test-server.log", "w")
    proc = subprocess.Popen([str(binary), "serve", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        seen = []
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"nebula serve exited with {proc.returncode}; see target/sdk-test-server.log")
            status, body = _health(base)
            if status is not None:
                seen.append((status, body))
            if status == 200:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"nebula serve was not ready after 120 s: {seen[-3:]}")
            time.sleep(0.05)
        # Every answer before readiness was the loading answer.
        assert all(s == (503, {"status": "loading"}) for s in seen[:-1]), seen
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
