#!/usr/bin/env bash
# Tests of deploy/entrypoint.sh, run by /bin/sh (dash, as in the images) with a fake `nvidia-smi` on PATH, a fake
# /proc/meminfo and /proc/cpuinfo, and the real `nebula profile detect`:
#   - every row of the profile table (VRAM and RAM as real cards and machines report them): the profile written,
#     the environment `nebula serve` gets (NEBULA_MAX_CONTEXT, NEBULA_HOST=0.0.0.0, CUDA_VISIBLE_DEVICES, ...);
#   - the refusals: no GPU (nvidia-smi absent, or failing), below the minimum VRAM, RAM, both, missing model,
#     incomplete split model, a model of another architecture; each with its exit code and message, and no server;
#   - CPU mode (NEBULA_BACKEND=cpu, NEBULA_ALLOW_CPU=1), the largest of several GPUs, settings that win over the
#     profile, pass-through subcommands;
#   - the real chain once: the entry point execs the real `nebula serve` in CPU mode on the demo model, and /health
#     and /v1/models answer.
# `nebula serve` is replaced by a recorder except in the last test.
#
# Usage: deploy/tests/entrypoint_test.sh [path/to/nebula]   (default: target/release/nebula)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
REAL_NEBULA=$(realpath "${1:-${NEBULA_REAL_BIN:-target/release/nebula}}")
[ -x "$REAL_NEBULA" ] || { echo "no nebula binary at $REAL_NEBULA (cargo build --release -p nebula-service)" >&2; exit 2; }
ENTRYPOINT="$ROOT/deploy/entrypoint.sh"
DEMO_MODEL="$ROOT/models/nebula-demo.gguf"

WORK=$(mktemp -d)
SERVER_PID=
cleanup() {
    if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT

mkdir -p "$WORK/bin" "$WORK/nosmi-bin"
# The fake nebula: `profile` runs the real one, `serve` records its arguments and environment, others record too.
cat > "$WORK/bin/nebula" <<'EOF'
#!/bin/sh
if [ "$1" = profile ]; then exec "$REAL_NEBULA" "$@"; fi
{ echo "ARGS: $*"; env | grep -E '^(NEBULA_|CUDA_)' | sort; } > "$RECORD"
exit 0
EOF
# The fake nvidia-smi: checks it is asked the documented query, then answers from $FAKE_SMI_CSV, or fails like
# nvidia-smi without a driver when FAKE_SMI_FAIL is set.
cat > "$WORK/bin/nvidia-smi" <<'EOF'
#!/bin/sh
if [ -n "${FAKE_SMI_FAIL:-}" ]; then
    echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running."
    exit 9
fi
if [ "$*" != "--query-gpu=index,name,memory.total --format=csv,noheader,nounits" ]; then
    echo "fake nvidia-smi: unexpected arguments: $*" >&2
    exit 64
fi
cat "$FAKE_SMI_CSV"
EOF
cp "$WORK/bin/nebula" "$WORK/nosmi-bin/nebula"
chmod +x "$WORK/bin/nebula" "$WORK/bin/nvidia-smi" "$WORK/nosmi-bin/nebula"

# An 8-core, 16-thread CPU; the profile's threads are its 8 physical cores, at most the CPUs this process may use.
EXPECT_THREADS=$(nproc)
[ "$EXPECT_THREADS" -gt 8 ] && EXPECT_THREADS=8
for p in $(seq 0 15); do printf 'processor\t: %d\nphysical id\t: 0\ncore id\t\t: %d\n\n' "$p" $((p % 8)); done > "$WORK/cpuinfo"

PASSED=0
FAILED=0
fail() { echo "FAIL [$CASE]: $*" >&2; FAILED=$((FAILED + 1)); CASE_OK=0; }

# run_entrypoint CASE_NAME VRAM_CSV MEMTOTAL_KB [KEY=VALUE ...] [-- ENTRYPOINT ARGS]
# Leaves RC, ERR (stderr), RECORD (file; absent when the server was not started), PROFILE.
run_entrypoint() {
    CASE=$1 CASE_OK=1
    local csv=$2 memtotal=$3
    shift 3
    local dir="$WORK/case-$((PASSED + FAILED))"
    mkdir -p "$dir"
    printf '%b' "$csv" > "$dir/smi.csv"
    printf 'MemTotal:       %s kB\nMemFree:         1000000 kB\nMemAvailable:   %s kB\n' "$memtotal" $((memtotal / 2)) > "$dir/meminfo"
    RECORD="$dir/record" PROFILE="$dir/state/profile.toml"
    local env_args=(
        "PATH=$WORK/bin:/usr/bin:/bin" "HOME=$dir" "REAL_NEBULA=$REAL_NEBULA" "RECORD=$RECORD"
        "NEBULA_BIN=nebula" "NEBULA_PROFILE=$PROFILE" "NEBULA_MEMINFO=$dir/meminfo" "NEBULA_CPUINFO=$WORK/cpuinfo"
        "NEBULA_CGROUP_MEMORY=none" "FAKE_SMI_CSV=$dir/smi.csv" "NEBULA_MODEL=$DEMO_MODEL"
    )
    while [ $# -gt 0 ] && [ "$1" != -- ]; do env_args+=("$1"); shift; done
    [ "${1:-}" = -- ] && shift
    RC=0
    env -i "${env_args[@]}" /bin/sh "$ENTRYPOINT" "$@" > "$dir/out" 2> "$dir/err" || RC=$?
    ERR=$(cat "$dir/err")
}

expect_rc() { [ "$RC" = "$1" ] || fail "exit code $RC, expected $1; stderr: $ERR"; }
expect_err() { grep -qF -- "$1" <<< "$ERR" || fail "stderr lacks '$1'; stderr: $ERR"; }
expect_no_server() { [ ! -e "$RECORD" ] || fail "nebula serve was started: $(cat "$RECORD")"; }
expect_served() {
    [ -e "$RECORD" ] || { fail "nebula serve was not started; stderr: $ERR"; return; }
    local line
    for line in "$@"; do grep -qxF -- "$line" "$RECORD" || fail "serve did not get '$line': $(tr '\n' ' ' < "$RECORD")"; done
}
expect_not_in_record() { ! grep -q -- "$1" "$RECORD" 2>/dev/null || fail "serve got '$1': $(tr '\n' ' ' < "$RECORD")"; }
expect_profile() {
    [ -e "$PROFILE" ] || { fail "no profile at $PROFILE"; return; }
    local line
    for line in "$@"; do grep -qxF -- "$line" "$PROFILE" || fail "profile lacks '$line'"; done
}
# The placement as "gpu=X ram=Y+copies ssd=Z".
placement() {
    awk '/^\[\[placement\]\]/{t=""} /^tier = /{gsub(/"/,"",$3); t=$3} /^experts_per_layer = /{if(t!="") n[t]=$3}
         /^gpu_copies = /{c=$3} END{printf "gpu=%s ram=%s+%s ssd=%s", n["gpu"], n["ram"], c, n["ssd"]}' "$PROFILE"
}
done_case() { if [ "$CASE_OK" = 1 ]; then PASSED=$((PASSED + 1)); echo "ok   $CASE"; fi; }

# ---- every row of the product's table, typed in again here -------------------------------------------------------
# VRAM step: nvidia-smi MiB of a real card of that size, GPU experts, max prefill, Nebula's max context (the
# original's 8192/24576/49152/98304 raised by the 8-bit KV cache and its hot window) and KV window.
declare -A VRAM_MIB=([8]=8188 [12]=12282 [16]=16376 [24]=24564)
declare -A GPU_EXPERTS=([8]=11 [12]=27 [16]=34 [24]=54)
declare -A PREFILL=([8]=1024 [12]=2048 [16]=4096 [24]=8182)
declare -A CONTEXT=([8]=65536 [12]=131072 [16]=262144 [24]=262144)
declare -A KV_WINDOW=([8]=16384 [12]=65536 [16]=131072 [24]=0)
# RAM step: MemTotal (kB) of a machine with that much installed.
declare -A MEMTOTAL=([32]=32612000 [64]=65700000 [96]=98500000 [128]=131600000)
# CPU experts and SSD experts per (VRAM, RAM).
declare -A CPU_EXPERTS=(
    [8,32]=141 [8,64]=400 [8,96]=501 [8,128]=501 [12,32]=124 [12,64]=383 [12,96]=485 [12,128]=485
    [16,32]=114 [16,64]=372 [16,96]=478 [16,128]=478 [24,32]=90 [24,64]=348 [24,96]=458 [24,128]=458
)
declare -A SSD_EXPERTS=(
    [8,32]=360 [8,64]=101 [8,96]=0 [8,128]=0 [12,32]=361 [12,64]=102 [12,96]=0 [12,128]=0
    [16,32]=364 [16,64]=106 [16,96]=0 [16,128]=0 [24,32]=368 [24,64]=110 [24,96]=0 [24,128]=0
)
for vram in 8 12 16 24; do
    for ram in 32 64 96 128; do
        ngram=ssd
        [ "$ram" = 128 ] && ngram=ram
        run_entrypoint "row ${vram}gb-vram-${ram}gb-ram" "0, NVIDIA Test ${vram}GB, ${VRAM_MIB[$vram]}\n" "${MEMTOTAL[$ram]}"
        expect_rc 0
        # The demo model's experts are Q8_0, not the table's Q4_K/IQ4_NL: the row's tiers are recounted for its
        # expert size, and its tiny dense weights leave the VRAM step for the GPU tier, which then grows into it
        # (profile fill_vram): every GPU expert keeps its RAM copy, the SSD tier keeps at least the table's, the
        # three tiers still hold 512.
        expect_profile "name = \"${vram}gb-vram-${ram}gb-ram\"" 'backend = "cuda"' 'source = "original-expert-size"' \
            "vram_gb = $vram" "ram_gb = $ram" "max_context = ${CONTEXT[$vram]}" "max_prefill = ${PREFILL[$vram]}" \
            "ngram_table = \"$ngram\"" "threads = $EXPECT_THREADS" "model = \"$DEMO_MODEL\"" \
            'kv_cache_type = "q8_0"' "kv_window = ${KV_WINDOW[$vram]}"
        read -r g r c d <<< "$(placement | sed -E 's/gpu=([0-9]+) ram=([0-9]+)\+([0-9]+) ssd=([0-9]+)/\1 \2 \3 \4/')"
        { [ "$((g + r + d))" = 512 ] && [ "$c" = "$g" ] && [ "$d" -ge "${SSD_EXPERTS[$vram,$ram]}" ]; } ||
            fail "placement $(placement): not the row's tiers recounted and filled for the demo's experts (table: gpu=${GPU_EXPERTS[$vram]} ram=${CPU_EXPERTS[$vram,$ram]}+${GPU_EXPERTS[$vram]} ssd=${SSD_EXPERTS[$vram,$ram]})"
        expect_served "ARGS: serve" "NEBULA_HOST=0.0.0.0" "NEBULA_MAX_CONTEXT=${CONTEXT[$vram]}" \
            "NEBULA_PROFILE=$PROFILE" "NEBULA_BACKEND=cuda" "CUDA_VISIBLE_DEVICES=0" "CUDA_DEVICE_ORDER=PCI_BUS_ID" \
            "NEBULA_MODEL=$DEMO_MODEL"
        done_case
    done
done

# ---- refusals ---------------------------------------------------------------------------------------------------
run_entrypoint "no GPU: nvidia-smi absent" "" 65700000 "PATH=$WORK/nosmi-bin:/usr/bin:/bin" \
    "NEBULA_NVIDIA_SMI=$WORK/nosmi-bin/nvidia-smi"
expect_rc 3
expect_err "no GPU: nvidia-smi cannot be run"
expect_err "no NVIDIA GPU is visible in this container"
expect_err "--gpus all"
expect_err "NEBULA_BACKEND=cpu"
expect_no_server
done_case

run_entrypoint "no GPU: nvidia-smi fails (no driver)" "" 65700000 FAKE_SMI_FAIL=1
expect_rc 3
expect_err "nvidia-smi failed: NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"
expect_no_server
done_case

run_entrypoint "no GPU: nvidia-smi lists none" "" 65700000
expect_rc 3
expect_err "nvidia-smi lists no GPU"
expect_no_server
done_case

run_entrypoint "below minimum VRAM (6 GB card)" "0, NVIDIA GeForce RTX 2060, 6144\n" 65700000
expect_rc 4
expect_err "2.0 GiB of VRAM missing (the GPU has 6.0 GiB): the minimum is 8 GB"
expect_err "below Nebula's minimum"
expect_no_server
[ ! -e "$PROFILE" ] || fail "a profile was written"
done_case

run_entrypoint "below minimum RAM (16 GiB)" "0, NVIDIA GeForce RTX 4090, 24564\n" 16777216
expect_rc 4
expect_err "16.0 GiB of RAM missing (the machine has 16.0 GiB): the minimum is 32 GB"
grep -qF "VRAM missing" <<< "$ERR" && fail "VRAM reported missing"
expect_no_server
done_case

run_entrypoint "below minimum VRAM and RAM" "0, small, 4096\n" 25165824
expect_rc 4
expect_err "4.0 GiB of VRAM missing"
expect_err "8.0 GiB of RAM missing"
expect_no_server
done_case

run_entrypoint "two 6 GB GPUs are not added up" "0, a, 6144\n1, b, 6144\n" 65700000
expect_rc 4
expect_err "2.0 GiB of VRAM missing"
expect_no_server
done_case

run_entrypoint "missing model" "0, g, 12282\n" 65700000 NEBULA_MODEL=/models/Qwen3.8-Flash-Next-Q4_K_M-00001-of-00003.gguf
expect_rc 5
expect_err "3 of its 3 parts missing"
expect_err "/models/Qwen3.8-Flash-Next-Q4_K_M-00002-of-00003.gguf"
expect_err "nebula convert"
expect_err "-v /path/to/models:/models:ro"
expect_no_server
done_case

run_entrypoint "missing model (single file, typo)" "0, g, 12282\n" 65700000 NEBULA_MODEL="$ROOT/models/nebula-dem0.gguf"
expect_rc 5
expect_err "not found (GGUF files there: nebula-demo-mmproj.gguf, nebula-demo.gguf)"
expect_no_server
done_case

SPLIT="$WORK/split"
mkdir -p "$SPLIT"
cp "$DEMO_MODEL" "$SPLIT/qwen-00001-of-00002.gguf"
run_entrypoint "incomplete split model" "0, g, 12282\n" 65700000 NEBULA_MODEL="$SPLIT/qwen-00001-of-00002.gguf"
expect_rc 5
expect_err "is incomplete: 1 of its 2 parts missing: $SPLIT/qwen-00002-of-00002.gguf"
expect_no_server
done_case

head -c 100000 "$DEMO_MODEL" > "$SPLIT/truncated.gguf"
run_entrypoint "truncated model" "0, g, 12282\n" 65700000 NEBULA_MODEL="$SPLIT/truncated.gguf"
expect_rc 5
expect_err "cannot be read"
expect_err "download or convert it again"
expect_no_server
done_case

# ---- CPU mode, several GPUs, settings, pass-through -------------------------------------------------------------
run_entrypoint "CPU backend, demo model, 24 GiB machine" "" 25165824 NEBULA_BACKEND=cpu NEBULA_MODEL=
expect_rc 0
expect_err "serving the embedded demo model"
expect_profile 'name = "demo-cpu"' 'backend = "cpu"' 'model = "demo"'
expect_served "ARGS: serve" "NEBULA_BACKEND=cpu" "NEBULA_HOST=0.0.0.0" "NEBULA_MAX_CONTEXT=32768"
expect_not_in_record "CUDA_VISIBLE_DEVICES"
expect_not_in_record "NEBULA_MODEL="
done_case

run_entrypoint "no GPU with NEBULA_ALLOW_CPU=1: CPU profile" "" 65700000 "PATH=$WORK/nosmi-bin:/usr/bin:/bin" \
    "NEBULA_NVIDIA_SMI=$WORK/nosmi-bin/nvidia-smi" NEBULA_ALLOW_CPU=1
expect_rc 0
expect_profile 'name = "cpu-64gb-ram"' 'source = "derived-cpu-expert-size"'
expect_served "NEBULA_BACKEND=cpu" "NEBULA_MAX_CONTEXT=32768"
done_case

run_entrypoint "CPU backend, full model, 16 GiB: refused" "" 16777216 NEBULA_BACKEND=cpu
expect_rc 4
expect_err "16.0 GiB of RAM missing"
expect_no_server
done_case

run_entrypoint "the largest of three GPUs" "0, NVIDIA GeForce RTX 3060, 12288\n1, NVIDIA GeForce RTX 4090, 24564\n2, NVIDIA GeForce RTX 3070, 8192\n" 98500000
expect_rc 0
expect_profile 'name = "24gb-vram-96gb-ram"' 'gpu_index = 1' 'gpus = 3' 'cuda_visible_devices = "1"'
expect_served "CUDA_VISIBLE_DEVICES=1" "CUDA_DEVICE_ORDER=PCI_BUS_ID"
done_case

run_entrypoint "settings win over the profile" "0, g, 12282\n1, h, 12282\n" 65700000 NEBULA_MAX_CONTEXT=4096 \
    CUDA_VISIBLE_DEVICES=1 NEBULA_HOST=127.0.0.1 -- serve --port 9000 --queue 8
expect_rc 0
expect_profile 'gpu_index = 1'
expect_served "ARGS: serve --port 9000 --queue 8" "NEBULA_MAX_CONTEXT=4096" "CUDA_VISIBLE_DEVICES=1" "NEBULA_HOST=127.0.0.1"
expect_not_in_record "CUDA_DEVICE_ORDER"
done_case

run_entrypoint "serve flags without the word serve" "0, g, 12282\n" 65700000 -- --model-id qwen
expect_rc 0
expect_served "ARGS: serve --model-id qwen"
done_case

run_entrypoint "emulation: 8 GB / 32 GB on a 24 GB / 128 GB machine" "0, NVIDIA GeForce RTX 4090, 24564\n" 131600000 \
    NEBULA_VRAM_GIB=8 NEBULA_RAM_GIB=32 NEBULA_THREADS=1
expect_rc 0
expect_profile 'name = "8gb-vram-32gb-ram"' 'threads = 1'
grep -qF 'emulated = ["threads=1", "ram_gib=32", "vram_gib=8"]' "$PROFILE" || fail "emulation not recorded"
done_case

run_entrypoint "emulation cannot grow the machine" "0, g, 12282\n" 65700000 NEBULA_VRAM_GIB=24
expect_rc 2
expect_err "emulation can only shrink the budget"
expect_no_server
done_case

run_entrypoint "read-only profile volume falls back to /tmp" "0, g, 12282\n" 65700000 NEBULA_PROFILE=/proc/nebula/profile.toml
expect_rc 0
expect_err "writing the profile to /tmp/nebula"
expect_served "NEBULA_PROFILE=/tmp/nebula/profile.toml"
done_case

run_entrypoint "other subcommands pass through" "" 65700000 -- convert /ckpt -o /models/m.gguf
expect_rc 0
expect_served "ARGS: convert /ckpt -o /models/m.gguf"
[ -e "$PROFILE" ] && fail "detect ran for a pass-through command"
done_case

# ---- the real chain: entry point -> profile detect -> exec nebula serve (CPU, demo model) ----------------------
CASE="real nebula serve through the entry point" CASE_OK=1
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
printf 'MemTotal:       25165824 kB\n' > "$WORK/meminfo-real"
env -i "PATH=/usr/bin:/bin" "HOME=$WORK" "NEBULA_BIN=$REAL_NEBULA" "NEBULA_PROFILE=$WORK/real/profile.toml" \
    "NEBULA_MEMINFO=$WORK/meminfo-real" "NEBULA_CPUINFO=$WORK/cpuinfo" NEBULA_CGROUP_MEMORY=none \
    NEBULA_BACKEND=cpu NEBULA_HOST=127.0.0.1 "NEBULA_PORT=$PORT" RUST_LOG=warn \
    /bin/sh "$ENTRYPOINT" > "$WORK/real.out" 2> "$WORK/real.err" &
SERVER_PID=$!
status=
for _ in $(seq 1 120); do
    status=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/health" || true)
    [ "$status" = 200 ] && break
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 0.5
done
if [ "$status" = 200 ]; then
    models=$(curl -s "http://127.0.0.1:$PORT/v1/models")
    grep -q '"object":"list"' <<< "$models" || fail "/v1/models answered $models"
    grep -q 'name = "demo-cpu"' "$WORK/real/profile.toml" || fail "the profile was not written"
    # The entry point exec'd: the server is the process we started, not a child of a shell.
    [ "$(cat "/proc/$SERVER_PID/comm" 2>/dev/null)" = nebula ] || fail "process $SERVER_PID is $(cat "/proc/$SERVER_PID/comm"), not nebula"
else
    fail "/health never answered 200 (last: $status); stderr: $(cat "$WORK/real.err")"
fi
kill "$SERVER_PID" 2>/dev/null || true
wait "$SERVER_PID" 2>/dev/null || true
SERVER_PID=
done_case

echo "entrypoint tests: $PASSED passed, $FAILED failed"
[ "$FAILED" = 0 ]
