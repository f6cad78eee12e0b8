#!/usr/bin/env bash
# Nebula's test suite: everything CI runs. Needs cargo and python3 with pip; installs the pinned Python test
# packages, rebuilds the (uncommitted) tokenizer.json the tokenizer tests read, then runs every Rust test in
# release mode, the OpenAI Python SDK end-to-end test against a real `nebula serve`, and the WebUI's unit and
# browser tests (webui/scripts/test.sh installs Debian's chromium and nginx-light when they are missing).
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install --quiet --disable-pip-version-check -r scripts/requirements-test.txt
python3 scripts/make_tokenizer.py

cargo build --release --workspace --all-targets
cargo test --release --workspace
NEBULA_BIN=target/release/nebula DEPLOY_CHECK_SKIP_CARGO=1 deploy/check.sh
scripts/test_sdk.sh
webui/scripts/test.sh
echo "all tests passed"
