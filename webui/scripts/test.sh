#!/usr/bin/env bash
# The WebUI's whole test suite, one command (CI entry: `webui/scripts/test.sh` from the repository root or here).
# Installs what it needs: Debian's chromium and nginx-light when missing, the npm packages from package-lock.json;
# builds `nebula` (release) when neither NEBULA_BIN nor target/release/nebula exists. Then: type check, unit tests
# (Vitest), production build, end-to-end tests (node:test + playwright-core in headless Chromium, against a real
# `nebula serve`, the mock API, and nginx rendered from nginx/ as in the container).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(cd .. && pwd)

need_apt=()
[ -x /usr/bin/chromium ] || need_apt+=(chromium)
command -v nginx >/dev/null || need_apt+=(nginx-light)
command -v envsubst >/dev/null || need_apt+=(gettext-base)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "webui: installing ${need_apt[*]} from Debian"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
# Debian starts its own nginx on port 80 at install; the tests start theirs on free ports and need none.

node -e 'const [a,b]=process.versions.node.split(".").map(Number); if (a < 20 || (a === 20 && b < 19)) { console.error(`webui: Node.js >= 20.19 needed, found ${process.versions.node}`); process.exit(1) }'
npm ci --no-audit --no-fund --loglevel=error

npm run --silent check
npm test -- --reporter=default
npm run --silent build

export NEBULA_BIN=${NEBULA_BIN:-$repo/target/release/nebula}
if [ ! -x "$NEBULA_BIN" ]; then
  echo "webui: building nebula (release) for the end-to-end tests"
  (cd "$repo" && cargo build --release -p nebula-service)
fi
npm run --silent e2e
echo "webui: all tests passed"
