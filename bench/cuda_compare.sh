#!/usr/bin/env bash
# bench/cuda_compare.sh — lockstep's CUDA backend against llama.cpp's CUDA build, side by side,
# on one GPU machine, in one run, on the same GGUF file.
#
# The GPU machines this project borrows reach no network and hold no model weights, so the
# inputs are prepared where both are at hand and carried over (bench/README.md, "CUDA"):
#   BIN       a folder with `lockstep` and `cuda_bench` built with `--features cuda`
#             (cargo build --release -p lockstep-cli --features lockstep-cli/cuda;
#              cargo build --release -p lockstep-backend-cuda --features cuda --example cuda_bench)
#   MODEL     a .gguf file, or a skeleton from `lockstep synth --like NAME --skeleton`, which
#             is expanded here into a model with the real shapes, formats and tokenizer and
#             random weights
#   LLAMA_SRC the llama.cpp sources vendored in the llama-cpp-python==0.3.36 sdist (a folder
#             or a .tar.xz of one), built here with -DGGML_CUDA=ON for the GPU's
#             architecture unless LLAMA_BENCH names a built llama-bench
#
# Usage: bench/cuda_compare.sh BIN MODEL [LLAMA_SRC] [--rounds N] [--arch SM] [--check]
#   --rounds N  alternating rounds, lockstep first then llama.cpp in each (default 2)
#   --arch SM   CMAKE_CUDA_ARCHITECTURES for the peer (default 90, Hopper)
#   --check     also the correctness probes: CPU vs CUDA logits at full shape, G1, the cost
#               of the fixed block order (cuda_bench --check-cpu --unordered --profile)
# Prints lockstep's cuda_bench report and llama-bench's table per round; the ratios are
# lockstep t/s over llama.cpp t/s within the same round.

set -euo pipefail

die() { echo "cuda_compare: $*" >&2; exit 1; }
[[ $# -ge 2 ]] || die "usage: bench/cuda_compare.sh BIN MODEL [LLAMA_SRC] [--rounds N] [--arch SM] [--check]"
BIN="$1"; MODEL="$2"; shift 2
LLAMA_SRC=""
if [[ $# -gt 0 && "$1" != --* ]]; then LLAMA_SRC="$1"; shift; fi
ROUNDS=2; ARCH=90; CHECK=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --rounds) ROUNDS="$2"; shift 2 ;;
        --arch) ARCH="$2"; shift 2 ;;
        --check) CHECK=1; shift ;;
        *) die "unknown option $1" ;;
    esac
done
[[ -x "$BIN/lockstep" && -x "$BIN/cuda_bench" ]] || die "$BIN must hold lockstep and cuda_bench"
WORK="${TMPDIR:-/tmp}/lockstep-cuda-compare"
mkdir -p "$WORK"
export PATH="/usr/local/cuda/bin:$PATH"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true

# The model: a skeleton is expanded (same seed, same file).
if "$BIN/lockstep" inspect "$MODEL" 2>/dev/null | grep -q "lockstep.synth.tensors"; then
    "$BIN/lockstep" synth --like "$MODEL" --out "$WORK/model.gguf" --seed 1
    MODEL="$WORK/model.gguf"
fi

# The peer.
LB="${LLAMA_BENCH:-}"
if [[ -z "$LB" && -n "$LLAMA_SRC" ]]; then
    src="$LLAMA_SRC"
    if [[ -f "$src" ]]; then
        rm -rf "$WORK/llama-src" && mkdir -p "$WORK/llama-src"
        tar -C "$WORK/llama-src" -xf "$src"
        src="$(dirname "$(find "$WORK/llama-src" -maxdepth 2 -name CMakeLists.txt | head -1)")"
    fi
    cmake -S "$src" -B "$WORK/llama-build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DGGML_NATIVE=OFF -DGGML_CUDA_CUB_3DOT2=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > "$WORK/llama-cmake.log" 2>&1 \
        || die "llama.cpp configure failed (see $WORK/llama-cmake.log)"
    cmake --build "$WORK/llama-build" --target llama-bench -j "$(nproc)" > "$WORK/llama-build.log" 2>&1 \
        || die "llama.cpp build failed (see $WORK/llama-build.log)"
    LB="$WORK/llama-build/bin/llama-bench"
fi

if [[ $CHECK == 1 ]]; then
    "$BIN/cuda_bench" "$MODEL" --check-cpu --unordered --profile
fi
for round in $(seq 1 "$ROUNDS"); do
    echo "== round $round: lockstep"
    "$BIN/cuda_bench" "$MODEL"
    if [[ -n "$LB" ]]; then
        echo "== round $round: llama.cpp"
        "$LB" -m "$MODEL" -ngl 99 -p 512 -n 128 -r 5 -o md
    fi
done
