#!/usr/bin/env bash
# Every check of the container and deployment files, in one command (what CI runs through scripts/test.sh):
#   1. static checks (deploy/checks.py): hadolint on both Dockerfiles, shellcheck, compose.yaml against the Compose
#      Specification schema, the Grafana dashboard and Prometheus config, the Helm chart linted, rendered and
#      validated against the Kubernetes 1.27 and 1.37 schemas (its inference-gateway resources against their
#      upstream CRDs, deploy/crds/); then a self-test showing each check fails on a deliberately broken copy of
#      its file;
#   2. the entry point with a fake nvidia-smi and fake meminfo for every profile row and every refusal
#      (deploy/tests/entrypoint_test.sh), ending with a real `nebula serve` started through it;
#   3. the profile unit tests (cargo test -p nebula-service --lib profile).
# Installs its tools from PyPI (deploy/requirements-check.txt) into build/deploy-venv. Needs python3, cargo, curl.
# Set NEBULA_BIN to use an existing nebula binary; DEPLOY_CHECK_SKIP_CARGO=1 skips step 3.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=build/deploy-venv
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r deploy/requirements-check.txt
export PATH="$PWD/$VENV/bin:$PATH"

echo "== static checks"
"$VENV/bin/python" deploy/checks.py --self-test

echo "== entry point"
NEBULA=${NEBULA_BIN:-target/release/nebula}
if [ -z "${NEBULA_BIN:-}" ]; then
    cargo build --release --quiet -p nebula-service --bin nebula
fi
deploy/tests/entrypoint_test.sh "$NEBULA"

if [ "${DEPLOY_CHECK_SKIP_CARGO:-0}" != 1 ]; then
    echo "== profile unit tests"
    cargo test --release --quiet -p nebula-service --lib profile
fi
echo "deploy checks passed"
