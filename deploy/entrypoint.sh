#!/bin/sh
# Nebula container entry point.
#
#   1. `nebula profile detect` reads nvidia-smi, /proc/meminfo (and the container's memory limit) and the cores,
#      chooses a row of deploy/profiles.toml and writes it to $NEBULA_PROFILE (a volume), checking the model at
#      $NEBULA_MODEL (every split part present, a valid qwen4exp GGUF);
#   2. `exec nebula serve` with the profile: NEBULA_PROFILE, NEBULA_BACKEND and NEBULA_MAX_CONTEXT (unless set)
#      come from it, CUDA_VISIBLE_DEVICES selects the chosen GPU (unless set), and it binds 0.0.0.0.
#
# Arguments: none or `serve [FLAGS]` or `--flag ...` run the server (flags go to `nebula serve`); any other
# subcommand runs as is (`convert ...`, `profile detect --out - ...`, `--version`).
#
# Settings (environment):
#   NEBULA_MODEL       GGUF to serve (split files: the first part), e.g. /models/Qwen3.8-Flash-Next-Q4_K_M-00001-of-00003.gguf.
#                      Unset: the embedded demo model (the hardware minimums then do not apply).
#   NEBULA_BACKEND     auto (default: the GPU, refuse without one), cuda, or cpu.
#   NEBULA_ALLOW_CPU   1: with auto and no GPU, run on the CPU instead of refusing.
#   NEBULA_PROFILE     where the profile is written (default /var/lib/nebula/profile.toml).
#   NEBULA_VRAM_GIB, NEBULA_RAM_GIB, NEBULA_THREADS   emulate a smaller machine (benchmarks).
#   NEBULA_HOST, NEBULA_PORT, NEBULA_MAX_CONTEXT, ... everything `nebula serve --help` lists.
#
# Exit codes (before the server starts): 3 no GPU visible, 4 below the minimum VRAM/RAM, 5 model missing or
# incomplete, 1 other errors; then the server's own.
set -eu

NEBULA_BIN=${NEBULA_BIN:-nebula}
export NEBULA_PROFILE="${NEBULA_PROFILE:-/var/lib/nebula/profile.toml}"
export NEBULA_HOST="${NEBULA_HOST:-0.0.0.0}"
backend="${NEBULA_BACKEND:-auto}"

log() { printf 'nebula-entrypoint: %s\n' "$*" >&2; }

case "${1:-serve}" in
    serve) if [ $# -gt 0 ]; then shift; fi ;;
    -*) ;;
    *) exec "$NEBULA_BIN" "$@" ;;
esac

# An empty NEBULA_MODEL means "not set": the embedded demo model.
if [ -z "${NEBULA_MODEL:-}" ]; then
    unset NEBULA_MODEL
fi

# The profile volume may be mounted read-only or owned by another user (a hostPath): fall back to /tmp.
profile_dir=$(dirname "$NEBULA_PROFILE")
if ! mkdir -p "$profile_dir" 2>/dev/null || [ ! -w "$profile_dir" ]; then
    log "cannot write to $profile_dir (volume read-only or owned by another user); writing the profile to /tmp/nebula"
    export NEBULA_PROFILE=/tmp/nebula/profile.toml
fi

rc=0
if [ -n "${NEBULA_MODEL:-}" ]; then
    "$NEBULA_BIN" profile detect --out "$NEBULA_PROFILE" --backend "$backend" --model "$NEBULA_MODEL" || rc=$?
else
    log "NEBULA_MODEL is not set: serving the embedded demo model (mount a real model and set NEBULA_MODEL to serve Qwen3.8-Flash-Next)"
    "$NEBULA_BIN" profile detect --out "$NEBULA_PROFILE" --backend "$backend" --demo || rc=$?
fi

case $rc in
    0) ;;
    3)
        log "no NVIDIA GPU is visible in this container."
        log "  Run it with the NVIDIA Container Toolkit: 'docker compose up' (the compose file reserves one GPU) or"
        log "  'docker run --gpus all ...'; check 'nvidia-smi' works on the host."
        log "  Without a GPU: NEBULA_BACKEND=cpu (or 'docker compose --profile cpu up' for the demo model)."
        exit 3
        ;;
    4)
        log "this machine is below Nebula's minimum for the full model (8 GB VRAM, 32 GB RAM); see the line above."
        log "  In a container with a memory limit, raise it (docker run --memory, compose mem_limit, Kubernetes limits)."
        exit 4
        ;;
    5)
        log "the model is missing or incomplete; see the line above. The weights come from a volume:"
        log "  compose: put the GGUF file(s) in \${NEBULA_MODELS_DIR:-./models} on the host and set NEBULA_MODEL_FILE to"
        log "    the file name (split models: the first part); they are mounted read-only at /models."
        log "  docker run: -v /path/to/models:/models:ro -e NEBULA_MODEL=/models/<file>.gguf"
        log "  To convert a Hugging Face checkpoint: docker run --rm -v /path/to/checkpoint:/ckpt:ro \\"
        log "    -v /path/to/models:/models IMAGE convert /ckpt -o /models/Qwen3.8-Flash-Next.gguf --outtype q8_0"
        exit 5
        ;;
    *)
        log "nebula profile detect failed (exit $rc)"
        exit "$rc"
        ;;
esac

# Top-level keys of the profile (they all come before its first [table]).
profile_value() {
    sed -n -e '/^\[/q' -e "s/^$1 = \"\{0,1\}\([^\"]*\)\"\{0,1\}\$/\1/p" "$NEBULA_PROFILE"
}

profile_backend=$(profile_value backend)
export NEBULA_BACKEND="$profile_backend"
if [ -z "${NEBULA_MAX_CONTEXT:-}" ]; then
    NEBULA_MAX_CONTEXT=$(profile_value max_context)
    export NEBULA_MAX_CONTEXT
fi
if [ "$profile_backend" = cuda ] && [ -z "${CUDA_VISIBLE_DEVICES:-}" ]; then
    gpu=$(profile_value cuda_visible_devices)
    if [ -n "$gpu" ]; then
        # nvidia-smi numbers GPUs in PCI bus order; make CUDA number them the same way.
        export CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES="$gpu"
    fi
fi

log "profile $(profile_value name) ($profile_backend), written to $NEBULA_PROFILE; starting nebula serve on $NEBULA_HOST:${NEBULA_PORT:-8090}"
exec "$NEBULA_BIN" serve "$@"
