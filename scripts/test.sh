#!/usr/bin/env bash
# Nebula's test suite: everything CI runs. Needs cargo and python3 with pip; installs the pinned Python test
# packages, rebuilds the (uncommitted) tokenizer.json the tokenizer tests read, then runs every Rust test in
# release mode (the HTTP end-to-end and 32-client load tests among them), every CUDA source through NVRTC, the OpenAI Python SDK end-to-end test
# and schemathesis (property-based, against openapi/openapi.json) against a real `nebula serve`, and the WebUI's unit and
# browser tests (webui/scripts/test.sh installs Debian's chromium and nginx-light when they are missing).
set -euo pipefail
cd "$(dirname "$0")/.."

# The Python truth sources live in their own venv (works on distributions that forbid system-wide pip, PEP 668).
venv=build/test-venv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r scripts/requirements-test.txt
"$venv/bin/python" scripts/make_tokenizer.py

cargo build --release --workspace --all-targets
cargo test --release --workspace
# Every CUDA source through NVRTC exactly as the GPU backend compiles it at start (libnvrtc from PyPI; no GPU).
nvrtc_lib=$("$venv/bin/python" -c 'import nvidia, pathlib; print(next(pathlib.Path(p) / "cu13" / "lib" for p in nvidia.__path__))')
LD_LIBRARY_PATH="$nvrtc_lib" cargo test --release -p nebula-kernels -- --ignored nvrtc
NEBULA_BIN=target/release/nebula DEPLOY_CHECK_SKIP_CARGO=1 deploy/check.sh
scripts/test_sdk.sh
scripts/test_api_schema.sh
webui/scripts/test.sh
echo "all tests passed"
