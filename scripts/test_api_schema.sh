#!/usr/bin/env bash
# schemathesis (property-based API testing, pinned in scripts/requirements-schema.txt) against a running
# `nebula serve` with the embedded demo model and the committed openapi/openapi.json: no 5xx, every response
# matches its documented status, content type and schema. The server runs with a small context (1024 tokens) and
# a short repetition window so that every generated request ends quickly.
#
#   scripts/test_api_schema.sh                  # builds target/release/nebula if needed
#   NEBULA_BIN=path/to/nebula scripts/test_api_schema.sh --max-examples 20   # extra args go to schemathesis
#
# The server's log goes to target/schema-test-server.log.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${NEBULA_BIN:-}" ]]; then
    cargo build --release -p nebula-service --bin nebula
    NEBULA_BIN="$PWD/target/release/nebula"
fi
venv="$(realpath -m "${NEBULA_SCHEMA_VENV:-target/schema-venv}")"
if [[ ! -x "$venv/bin/python" ]]; then
    python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r scripts/requirements-schema.txt

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
base="http://127.0.0.1:$port"
env -u NEBULA_API_KEY NEBULA_MAX_CONTEXT=1024 NEBULA_DEFAULTS__REPETITION_WINDOW=64 RUST_LOG=info \
    "$NEBULA_BIN" serve --port "$port" > target/schema-test-server.log 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT
for _ in $(seq 1200); do
    if python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$base/health" \
        > /dev/null 2>&1; then break; fi
    if ! kill -0 "$server" 2>/dev/null; then echo "nebula serve exited; see target/schema-test-server.log"; exit 1; fi
    sleep 0.1
done

# schemathesis' and Hypothesis' caches stay out of the work tree (schemathesis writes .schemathesis/ in its cwd).
schema="$PWD/openapi/openapi.json"
mkdir -p target/schemathesis
cd target/schemathesis
export HYPOTHESIS_STORAGE_DIRECTORY="$PWD/hypothesis"
"$venv/bin/schemathesis" run "$schema" --url "$base" \
    --checks not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance \
    --phases examples,coverage,fuzzing --max-examples 40 --workers 1 --request-timeout 120 \
    --suppress-health-check too_slow,filter_too_much --warnings off "$@"
