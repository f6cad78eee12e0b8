#!/usr/bin/env bash
# The SDK tests (tests/sdk: the OpenAI and Anthropic Python SDKs, openai-agents, replays of Claude Code and Codex CLI
# requests) against `nebula serve` on the embedded demo model, in one command.
#
#   scripts/test_sdk.sh              # builds target/release/nebula if needed, then runs pytest
#   NEBULA_BIN=path/to/nebula scripts/test_sdk.sh -k stream   # another binary; extra args go to pytest
#
# The SDK and pytest versions are pinned in tests/sdk/requirements.txt and installed into a venv
# ($NEBULA_SDK_VENV, default target/sdk-venv). The server's log goes to target/sdk-test-server.log.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${NEBULA_BIN:-}" ]]; then
    cargo build --release -p nebula-service --bin nebula
    export NEBULA_BIN="$PWD/target/release/nebula"
fi

venv="${NEBULA_SDK_VENV:-target/sdk-venv}"
if [[ ! -x "$venv/bin/python" ]]; then
    python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r tests/sdk/requirements.txt
exec "$venv/bin/python" -m pytest tests/sdk -q "$@"
