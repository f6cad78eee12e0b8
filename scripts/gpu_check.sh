#!/usr/bin/env bash
# GPU checks and benchmarks of record, for a machine with an NVIDIA GPU (the `device` H200 has no Rust: build the
# binaries elsewhere and pass them in). Runs, in order:
#   1. the GPU tests (against the CPU engine and the reference logits),
#   2. a 12-layer real-width synthetic model (`nebula synth --recipe nebula-q4 --no-mtp`),
#   3. `nebula bench model` all on the GPU (and, when Nsight Compute is installed, the per-kernel time of one decode
#      step: scripts/ncu_decode_profile.py), the prefill profile at 2048, `nebula bench mtp` on a synth with the
#      MTP block, then hybrid under the 12 GB / 128 GB and 8 GB / 32 GB profiles (before the hybrid runs: the
#      decode A/B of the launch fusions and the opt-in GEMV prologues, AB_ROUNDS=6 interleaved processes each; and
#      the host's CPU kernels against its read bandwidth, with the MoE kernel's prefetch and work-item settings),
#   4. llama.cpp's `llama-bench` on the same file when LLAMA_BENCH points at one (this script never builds it).
#
# Usage (from the repository root):
#   NEBULA=path/to/nebula GPU_TESTS=path/to/gpu-test-binary [GPU_VISION_TESTS=path/to/gpu_vision-test-binary] \
#     [LLAMA_BENCH=path/to/llama-bench] [WORK=/tmp/nebula-gpu] [LAYERS=12] scripts/gpu_check.sh
# Build here with CUDA_HOME set: `cargo build --release -p nebula-service --features lean` (the `nebula`
# binary) and `cargo test --release -p nebula-tests --test gpu --no-run` (prints the test binary's path).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
NEBULA=${NEBULA:?set NEBULA to the nebula binary}
WORK=${WORK:-/tmp/nebula-gpu}
LAYERS=${LAYERS:-12}
mkdir -p "$WORK"

if [ -n "${GPU_TESTS:-}" ]; then
    echo "=== GPU tests"
    (cd "$ROOT" && NEBULA_REPO_ROOT="$ROOT" "$GPU_TESTS" --ignored --nocapture --test-threads 1)
fi
if [ -n "${GPU_VISION_TESTS:-}" ]; then
    echo "=== GPU vision tests (cargo test --release -p nebula-tests --test gpu_vision --no-run)"
    (cd "$ROOT" && NEBULA_REPO_ROOT="$ROOT" "$GPU_VISION_TESTS" --ignored --nocapture --test-threads 1)
fi

MODEL="$WORK/synth-$LAYERS.gguf"
if [ ! -f "$MODEL" ]; then
    echo "=== nebula synth ($LAYERS layers, nebula-q4, no MTP block so llama.cpp 0.3.36 reads it)"
    "$NEBULA" synth --out "$MODEL" --layers "$LAYERS" --recipe nebula-q4 --no-mtp \
        --tokenizer-from "$ROOT/models/nebula-demo.gguf"
    sync # the file's write-back competes with the CPU benchmarks below otherwise
fi

MMPROJ="$WORK/synth-vision.gguf"
if [ ! -f "$MMPROJ" ]; then
    echo "=== nebula synth --mmproj (a random tower of the released shapes: 24 blocks, width 1024)"
    "$NEBULA" synth --out "$WORK/synth-vision-lm.gguf" --layers 4 --recipe nebula-q4 --no-mtp --mmproj "$MMPROJ" \
        --tokenizer-from "$ROOT/models/nebula-demo.gguf"
fi
echo "=== the vision tower on the GPU: encode time and one-image TTFT ($LAYERS-layer model)"
"$NEBULA" bench vision --model "$MODEL" --mmproj "$MMPROJ" --backend cuda --sizes 448x448,896x896,1792x1792

echo "=== all weights on the GPU"
"$NEBULA" bench model --model "$MODEL" --backend cuda --contexts 512,2048,8192 --decode 64
echo "=== all on the GPU, prefill without tensor cores (NEBULA_CUDA_MMA=0: dp4a experts, f32 cuBLAS dense)"
NEBULA_CUDA_MMA=0 "$NEBULA" bench model --model "$MODEL" --backend cuda --contexts 512,2048 --decode 4
# Repeats inside one process agree within 1-3 %, but whole processes of one binary land near ~400 or near ~445
# tok/s (H200, bimodal): an A/B needs many processes per setting, interleaved. Here: the launch fusions
# (NEBULA_CUDA_FUSE, on by default) and the opt-in GEMV prologues, AB_ROUNDS processes each.
for _ in $(seq "${AB_ROUNDS:-6}"); do
    for setting in "NEBULA_CUDA_FUSE=0" "NEBULA_CUDA_FUSE=shared,qkvz,gates" "NEBULA_CUDA_GEMV_PROLOGUE=1"; do
        echo "=== all on the GPU, decode A/B: $setting (3 repeats in one process)"
        env "$setting" "$NEBULA" bench model --model "$MODEL" --backend cuda --contexts 512,512,512 --decode 128 \
            | grep -E "^ +512"
    done
done

if command -v ncu > /dev/null; then
    echo "=== where one all-GPU decode step's time goes (Nsight Compute, CUDA Graphs off)"
    NEBULA_CUDA_GRAPHS=0 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
        "$NEBULA" bench model --model "$MODEL" --backend cuda --contexts 512 --decode 2 > "$WORK/ncu.csv" 2> "$WORK/ncu.err"
    python3 "$ROOT/scripts/ncu_decode_profile.py" "$WORK/ncu.csv" | head -25
fi

echo "=== prefill at 2048 tokens: phases, then kernels (all on the GPU; the stream is synchronised, so shares only)"
NEBULA_CUDA_PROFILE=1 "$NEBULA" bench model --model "$MODEL" --backend cuda --contexts 2048 --decode 4 | grep -A10 "prefill of" || true
NEBULA_CUDA_PROFILE=kernels "$NEBULA" bench model --model "$MODEL" --backend cuda --contexts 2048 --decode 4 \
    | grep -A13 "prefill of" || true

MTP_MODEL="$WORK/synth-$LAYERS-mtp.gguf"
if [ ! -f "$MTP_MODEL" ]; then
    echo "=== nebula synth ($LAYERS layers, nebula-q4, with the MTP block)"
    "$NEBULA" synth --out "$MTP_MODEL" --layers "$LAYERS" --recipe nebula-q4 \
        --tokenizer-from "$ROOT/models/nebula-demo.gguf"
fi
echo "=== MTP speculative decoding, all on the GPU (random MTP weights: read the scripted-rate rows)"
"$NEBULA" bench mtp --model "$MTP_MODEL" --backend cuda --prompt 2048 --tokens 128

echo "=== the host CPU (issue 3's bandwidth goal: are 16 vCPUs 16 cores or 8 with two threads each?)"
lscpu | grep -E "^(Model name|Socket|Core|Thread|CPU\(s\)|NUMA node\(s\)|L3)" || true
echo "AVX-512 extensions: $(grep -m1 -o -w -E 'avx512(f|bw|vl|_vnni|vbmi)' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "=== CPU kernels against the read bandwidth at 8-16 threads, then the MoE kernel's prefetch depth and work items"
"$NEBULA" bench kernels --threads 8,12,14,16 --types q4_k,iq4_nl --seconds 0.5
echo "=== the low-bit CPU kernels of the sixth session (direct Q2_K/Q3_K/Q5_K/IQ1_S dots, AVX-512 sign-index i-quants)"
"$NEBULA" bench kernels --threads 1,14,16 --types q2_k,q3_k,q5_k,iq1_s,iq2_xxs,iq2_xs,iq3_xxs,iq2_s,iq3_s --seconds 0.3
for pf in 0 8 16; do
    for rows in 32,64 64,128; do
        echo "=== MoE kernel, NEBULA_CPU_PREFETCH=$pf NEBULA_CPU_MOE_ROWS=$rows"
        NEBULA_CPU_PREFETCH=$pf NEBULA_CPU_MOE_ROWS=$rows "$NEBULA" bench kernels --threads 14,16 --types q4_k \
            --seconds 0.5 | sed -n '/^MoE kernel/,$p'
    done
done

P12="--gpu-experts 27 --ram-experts 512 --ngram-table ram --threads 14 --vram-budget-gib 12 --ram-budget-gib 128"
echo "=== hybrid, 12 GB VRAM / 128 GB RAM profile (with the CPU MoE timeline and the streamed-prefill timeline)"
# shellcheck disable=SC2086
NEBULA_CPU_MOE_TRACE=1 NEBULA_CUDA_PROFILE=copies \
    "$NEBULA" bench model --model "$MODEL" --backend cuda $P12 --contexts 2048,4096,8192 --decode 32
# shellcheck disable=SC2086
"$NEBULA" bench model --model "$MODEL" --backend cuda $P12 --contexts 32768 --decode 8

P8="--gpu-experts 11 --ram-experts 152 --ngram-table ssd --threads 14 --vram-budget-gib 8 --ram-budget-gib 32"
echo "=== hybrid, 8 GB VRAM / 32 GB RAM profile (SSD tier, n-gram table on SSD)"
# shellcheck disable=SC2086
"$NEBULA" bench model --model "$MODEL" --backend cuda $P8 --contexts 1024 --decode 32 --prefill-chunk 1024
echo "=== the same without the SSD prefetch gate (NEBULA_SSD_PREFETCH_GATE=0)"
# shellcheck disable=SC2086
NEBULA_SSD_PREFETCH_GATE=0 "$NEBULA" bench model --model "$MODEL" --backend cuda $P8 --contexts 1024 --decode 32 \
    --prefill-chunk 1024

if [ -n "${LLAMA_BENCH:-}" ]; then
    echo "=== llama.cpp, every routed expert in RAM (--n-cpu-moe $LAYERS), 14 threads, same file"
    "$LLAMA_BENCH" -m "$MODEL" -ngl 99 --n-cpu-moe "$LAYERS" -t 14 -p 2048,8192 -n 32 -r 1
    "$LLAMA_BENCH" -m "$MODEL" -ngl 99 --n-cpu-moe "$LAYERS" -t 14 -p 0 -n 32 -d 4096 -r 1
    echo "=== llama.cpp, all on the GPU"
    "$LLAMA_BENCH" -m "$MODEL" -ngl 99 -p 512,2048 -n 64 -r 3
fi
