#!/usr/bin/env bash
# bench/compare.sh — lockstep vs llama.cpp, side by side, on the same machine in the same run.
#
# What it does (see bench/README.md for the why and the caveats):
#   1. builds the peer, llama.cpp's `llama-bench` (and `llama-completion`, only used to print
#      ggml's system-info line), from the llama.cpp vendored in the PyPI sdist of
#      llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION, OUTSIDE this repository, under
#      $LOCKSTEP_HOME/peers/ (idempotent: an existing build is reused);
#   2. builds lockstep (`cargo build --release -p lockstep-cli`) when the binary is missing or
#      older than the sources, and resolves every model through lockstep itself
#      (`lockstep models`, `lockstep pull NAME`), so both engines read the very same files;
#   3. runs both engines with the same thread count and test sizes, alternating per model and
#      per round (ABBA order: llama.cpp first in odd rounds, lockstep first in even rounds),
#      because the machine is shared and noisy: only the ratio within one run is meaningful;
#   4. prints the peer's build/system info and one Markdown table (model × test: llama.cpp t/s,
#      lockstep t/s, ratio lockstep/llama.cpp), also written with the raw JSON under
#      target/bench/ (not committed unless the lead decides to).
#
# Requirements: bash, python3 (stdlib only), a C/C++ toolchain, cargo; cmake >= 3.14 is
# installed into $LOCKSTEP_HOME/peers/tools (a venv, `pip install cmake`) when absent.

set -euo pipefail

# --------------------------------------------------------------------------------------------
# Defaults and command line
# --------------------------------------------------------------------------------------------

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
# sha256 of llama_cpp_python-0.3.36.tar.gz as served by PyPI (checked only for that version).
LLAMA_CPP_PYTHON_SHA256_0_3_36="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

MODELS="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b"
THREADS=2
REPS=3
ROUNDS=2
N_PROMPT=512
N_GEN=128
OPENMP=ON
ISA=auto
BUILD_ONLY=0
LLAMA_ONLY=0
OUT_MD=""

usage() {
    cat <<EOF
Usage: bench/compare.sh [OPTIONS]

Benchmark lockstep against llama.cpp's llama-bench on the same GGUF files, same thread
count, alternating the two engines (ABBA per round) on a shared, noisy machine.

Options:
  --models A,B,...   models to measure: lockstep model names (see \`lockstep models\`) or
                     paths to .gguf files (default: $MODELS;
                     gemma3-270m is also known)
  --threads N        threads for both engines (default: $THREADS)
  --reps N           repetitions per engine invocation, -r of both benches (default: $REPS)
  --rounds N         alternating rounds; each round runs every model on both engines
                     (default: $ROUNDS)
  -p, --n-prompt N   prompt-processing test size, ppN (default: $N_PROMPT; 0 = none)
  -n, --n-gen N      generation test size, tgN (default: $N_GEN; 0 = none)
  --quick            smoke test: -p 64 -n 16 --reps 1 --rounds 1
  --openmp on|off    build/use llama.cpp with GGML_OPENMP on (default, llama.cpp's own
                     default) or off (separate build directory)
  --isa auto|avx2|avx512
                     instruction set of BOTH engines (default: auto = avx512 when this CPU
                     has AVX-512 F/BW/VL/VNNI, else avx2). avx2 builds the peer without
                     any AVX-512 (separate build directory) and runs lockstep with
                     LOCKSTEP_KERNELS=avx2 LOCKSTEP_CPU_ISA=avx2, so an AVX-512 machine
                     can stand in for an AVX2-only one (label such numbers "AVX2 forced
                     on an AVX-512 machine")
  --llama-only       run only the llama.cpp half (no lockstep build, no lockstep runs)
  --build-only       build llama-bench (and lockstep unless --llama-only), then exit
  --out FILE         also write the report here (default:
                     target/bench/compare-YYYYmmdd-HHMMSS.md; raw JSON next to it)
  -h, --help         this help

Exit status: 0 when every invocation succeeded, 2 when some failed (shown as "failed" in
the report, e.g. an architecture lockstep does not support yet), 1 on other errors.

Environment:
  LOCKSTEP_HOME      cache root: models/ and peers/ (default: \$XDG_CACHE_HOME/lockstep,
                     else ~/.cache/lockstep)
  LOCKSTEP_BIN       lockstep binary to use as is (default: built \${CARGO_TARGET_DIR:-target}/release/lockstep)
  LLAMA_BENCH        llama-bench binary to use as is (skips the peer build)
  LLAMA_CPP_PYTHON_VERSION   sdist version vendoring llama.cpp (default: 0.3.36)
  LOCKSTEP_PYTHON    Python for pip (default: python3)
  LOCKSTEP_PIP_ARGS  extra pip arguments, e.g. "--index-url https://mirror/simple"
  BUILD_JOBS         parallel compile jobs for the peer build (default: 2)

Examples:
  bench/compare.sh --quick --models smollm2-135m
  bench/compare.sh --threads 2 --rounds 3
  bench/compare.sh --llama-only --models smollm2-135m,qwen2.5-coder-0.5b
EOF
}

die() { echo "compare.sh: error: $*" >&2; exit 1; }
log() { echo "compare.sh: $*" >&2; }

# Positive integer check for option values.
want_uint() { [[ "$2" =~ ^[0-9]+$ ]] || die "$1 needs a non-negative integer, got '$2'"; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --models) [[ $# -ge 2 ]] || die "--models needs a value"; MODELS="$2"; shift 2 ;;
        --threads) [[ $# -ge 2 ]] || die "--threads needs a value"; want_uint "$1" "$2"; THREADS="$2"; shift 2 ;;
        --reps) [[ $# -ge 2 ]] || die "--reps needs a value"; want_uint "$1" "$2"; REPS="$2"; shift 2 ;;
        --rounds) [[ $# -ge 2 ]] || die "--rounds needs a value"; want_uint "$1" "$2"; ROUNDS="$2"; shift 2 ;;
        -p|--n-prompt) [[ $# -ge 2 ]] || die "$1 needs a value"; want_uint "$1" "$2"; N_PROMPT="$2"; shift 2 ;;
        -n|--n-gen) [[ $# -ge 2 ]] || die "$1 needs a value"; want_uint "$1" "$2"; N_GEN="$2"; shift 2 ;;
        --quick) N_PROMPT=64; N_GEN=16; REPS=1; ROUNDS=1; shift ;;
        --openmp)
            [[ $# -ge 2 ]] || die "--openmp needs on or off"
            case "${2,,}" in on) OPENMP=ON ;; off) OPENMP=OFF ;; *) die "--openmp needs on or off" ;; esac
            shift 2 ;;
        --isa)
            [[ $# -ge 2 ]] || die "--isa needs auto, avx2 or avx512"
            case "${2,,}" in auto|avx2|avx512) ISA="${2,,}" ;; *) die "--isa needs auto, avx2 or avx512" ;; esac
            shift 2 ;;
        --llama-only) LLAMA_ONLY=1; shift ;;
        --build-only) BUILD_ONLY=1; shift ;;
        --out) [[ $# -ge 2 ]] || die "--out needs a value"; OUT_MD="$2"; shift 2 ;;
        *) die "unknown option '$1' (see --help)" ;;
    esac
done
[[ "$THREADS" -ge 1 ]] || die "--threads must be at least 1"
[[ "$REPS" -ge 1 ]] || die "--reps must be at least 1"
[[ "$ROUNDS" -ge 1 ]] || die "--rounds must be at least 1"
[[ "$N_PROMPT" -gt 0 || "$N_GEN" -gt 0 ]] || die "nothing to measure: -p and -n are both 0"

# The instruction set of both engines: AVX-512 (with VNNI, as lockstep's fast path needs) when
# the CPU has it, else AVX2. A peer built with AVX-512 flags dies with SIGILL without it.
CPU_FLAGS=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | sed 's/^[^:]*://') "
has_flag() { [[ "$CPU_FLAGS" == *" $1 "* ]]; }
if [[ "$ISA" == auto ]]; then
    if has_flag avx512f && has_flag avx512bw && has_flag avx512vl && has_flag avx512_vnni; then
        ISA=avx512
    else
        ISA=avx2
    fi
fi
for f in avx avx2 fma f16c; do
    has_flag "$f" || die "this CPU lacks $f: neither peer build can run here"
done
if [[ "$ISA" == avx512 ]]; then
    for f in avx512f avx512bw avx512vl avx512_vnni avx512vbmi avx512_bf16; do
        has_flag "$f" || die "--isa avx512: this CPU lacks $f (use --isa avx2)"
    done
fi
# lockstep's kernel sets, forced down to AVX2 with --isa avx2: the matmuls and activation
# quantizer (LOCKSTEP_KERNELS, crates/quant) and the row ops and attention (LOCKSTEP_CPU_ISA,
# crates/backend-cpu).
LOCKSTEP_ISA_ENV=()
[[ "$ISA" == avx2 ]] && LOCKSTEP_ISA_ENV=(env LOCKSTEP_KERNELS=avx2 LOCKSTEP_CPU_ISA=avx2)

PYTHON="${LOCKSTEP_PYTHON:-python3}"
command -v "$PYTHON" >/dev/null || die "$PYTHON not found (set LOCKSTEP_PYTHON)"
BUILD_JOBS="${BUILD_JOBS:-2}"
# Extra pip arguments, split on whitespace on purpose (like lockstep's own LOCKSTEP_PIP_ARGS).
read -r -a PIP_ARGS <<<"${LOCKSTEP_PIP_ARGS:-}"

# The same cache root lockstep uses (hub::Cache::from_env): models/ and, for us, peers/.
if [[ -n "${LOCKSTEP_HOME:-}" ]]; then
    CACHE_ROOT="$LOCKSTEP_HOME"
elif [[ -n "${XDG_CACHE_HOME:-}" ]]; then
    CACHE_ROOT="$XDG_CACHE_HOME/lockstep"
else
    CACHE_ROOT="$HOME/.cache/lockstep"
fi
PEERS="$CACHE_ROOT/peers"
PEER_DIR="$PEERS/llama.cpp-$LLAMA_CPP_PYTHON_VERSION"
if [[ "$OPENMP" == ON ]]; then BUILD_DIR="$PEER_DIR/build"; else BUILD_DIR="$PEER_DIR/build-noomp"; fi
# The AVX2 peer has its own build directory (the AVX-512 one keeps its historical name).
[[ "$ISA" == avx2 ]] && BUILD_DIR="$BUILD_DIR-avx2"

# --------------------------------------------------------------------------------------------
# Peer build: llama-bench from the llama-cpp-python sdist
# --------------------------------------------------------------------------------------------

# The cmake flags of the peer build. Portable build for the chosen ISA (not -march=native,
# so the binary says exactly which ISA it uses): AVX-512 (F, VNNI, VBMI, BF16) or AVX2 (+FMA,
# F16C, BMI2, as on an AVX2-only EPYC; no AVX-512, no AVX-VNNI), AMX off (AMX faults on these
# machines), no curl/openssl (models are local files), static libraries so the binary stands
# alone.
cmake_flags() {
    local avx512=ON
    [[ "$ISA" == avx2 ]] && avx512=OFF
    printf '%s\n' \
        -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF \
        -DGGML_NATIVE=OFF \
        -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
        "-DGGML_AVX512=$avx512" "-DGGML_AVX512_VNNI=$avx512" "-DGGML_AVX512_VBMI=$avx512" \
        "-DGGML_AVX512_BF16=$avx512" \
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
        -DGGML_AVX_VNNI=OFF -DGGML_BMI2=ON \
        "-DGGML_OPENMP=$OPENMP" \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON
}

# Prints a cmake >= 3.14 to use, installing one with pip into $PEERS/tools when needed.
find_cmake() {
    local c ver
    for c in "$(command -v cmake || true)" "$PEERS/tools/bin/cmake"; do
        [[ -n "$c" && -x "$c" ]] || continue
        ver="$("$c" --version 2>/dev/null | head -n1 | grep -oE '[0-9]+\.[0-9]+' | head -n1 || true)"
        if [[ -n "$ver" ]] && printf '3.14\n%s\n' "$ver" | sort -C -V; then
            echo "$c"
            return 0
        fi
    done
    log "cmake not found (or older than 3.14): installing it from PyPI into $PEERS/tools"
    mkdir -p "$PEERS"
    "$PYTHON" -m venv "$PEERS/tools" >&2 \
        || die "could not create a venv for cmake; install cmake yourself (apt-get install cmake, or pip install cmake)"
    "$PEERS/tools/bin/python" -m pip install --quiet "${PIP_ARGS[@]}" 'cmake>=3.28' >&2 \
        || die "pip install cmake failed; install cmake yourself (apt-get install cmake)"
    [[ -x "$PEERS/tools/bin/cmake" ]] || die "pip installed no $PEERS/tools/bin/cmake"
    echo "$PEERS/tools/bin/cmake"
}

# Downloads and unpacks the sdist (once); prints the vendored llama.cpp source directory.
peer_sources() {
    local src="$PEER_DIR/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
    if [[ -f "$src/CMakeLists.txt" ]]; then
        echo "$src"
        return 0
    fi
    local dl="$PEER_DIR/download"
    local tarball="$dl/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
    mkdir -p "$dl"
    if [[ ! -f "$tarball" ]]; then
        log "downloading the llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION sdist from PyPI"
        # --no-binary for this package only: `--no-binary :all:` would also build its build
        # dependencies (cmake itself among them) from source just to prepare metadata.
        "$PYTHON" -m pip download --quiet --no-deps --no-binary llama-cpp-python \
            "${PIP_ARGS[@]}" -d "$dl" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" >&2 \
            || die "pip download of llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION failed"
    fi
    [[ -f "$tarball" ]] || die "pip did not produce $tarball"
    if [[ "$LLAMA_CPP_PYTHON_VERSION" == 0.3.36 ]]; then
        local got
        got="$(sha256sum "$tarball" | cut -d' ' -f1)"
        [[ "$got" == "$LLAMA_CPP_PYTHON_SHA256_0_3_36" ]] \
            || die "sha256 mismatch for $tarball: $got (expected $LLAMA_CPP_PYTHON_SHA256_0_3_36)"
    fi
    log "unpacking $tarball"
    rm -rf "$PEER_DIR/src.partial"
    mkdir -p "$PEER_DIR/src.partial"
    tar -xzf "$tarball" -C "$PEER_DIR/src.partial"
    rm -rf "$PEER_DIR/src"
    mv "$PEER_DIR/src.partial" "$PEER_DIR/src"
    [[ -f "$src/CMakeLists.txt" ]] || die "no vendor/llama.cpp in the sdist ($src)"
    echo "$src"
}

# Builds llama-bench and llama-completion unless both exist; sets LLAMA_BENCH/LLAMA_COMPLETION.
build_peer() {
    if [[ -n "${LLAMA_BENCH:-}" ]]; then
        [[ -x "$LLAMA_BENCH" ]] || die "LLAMA_BENCH=$LLAMA_BENCH is not an executable"
        LLAMA_COMPLETION="$(dirname "$LLAMA_BENCH")/llama-completion"
        log "llama-bench: $LLAMA_BENCH (from LLAMA_BENCH, not rebuilt)"
        return 0
    fi
    LLAMA_BENCH="$BUILD_DIR/bin/llama-bench"
    LLAMA_COMPLETION="$BUILD_DIR/bin/llama-completion"
    if [[ -x "$LLAMA_BENCH" && -x "$LLAMA_COMPLETION" ]]; then
        log "llama-bench: $LLAMA_BENCH (already built)"
        return 0
    fi
    # One builder at a time: a second compare.sh waits here, then finds the build done.
    mkdir -p "$PEER_DIR"
    exec {lock_fd}>"$PEER_DIR/.build.lock"
    if ! flock -n "$lock_fd"; then
        log "another compare.sh is building the peer; waiting for it"
        flock "$lock_fd"
    fi
    if [[ -x "$LLAMA_BENCH" && -x "$LLAMA_COMPLETION" ]]; then
        log "llama-bench: $LLAMA_BENCH (built meanwhile)"
        exec {lock_fd}>&-
        return 0
    fi
    local src cmake
    src="$(peer_sources)"
    cmake="$(find_cmake)"
    log "building llama-bench in $BUILD_DIR with $("$cmake" --version | head -n1), $BUILD_JOBS jobs (nice 10); this takes a while"
    mkdir -p "$BUILD_DIR"
    local flags
    mapfile -t flags < <(cmake_flags)
    # The configure log keeps ggml's "Adding CPU backend variant ...: <compiler flags>" line.
    nice -n 10 "$cmake" -S "$src" -B "$BUILD_DIR" "${flags[@]}" >"$BUILD_DIR/configure.log" 2>&1 \
        || { tail -n 30 "$BUILD_DIR/configure.log" >&2; die "cmake configure failed (log: $BUILD_DIR/configure.log)"; }
    nice -n 10 "$cmake" --build "$BUILD_DIR" --config Release -j "$BUILD_JOBS" \
        --target llama-bench llama-completion >"$BUILD_DIR/build.log" 2>&1 \
        || { tail -n 30 "$BUILD_DIR/build.log" >&2; die "build failed (log: $BUILD_DIR/build.log)"; }
    [[ -x "$LLAMA_BENCH" ]] || die "the build produced no $LLAMA_BENCH"
    exec {lock_fd}>&-
    log "llama-bench: $LLAMA_BENCH (built)"
}

# --------------------------------------------------------------------------------------------
# lockstep build and model resolution
# --------------------------------------------------------------------------------------------

# Builds lockstep when the binary is missing or any source is newer; sets LOCKSTEP.
build_lockstep() {
    if [[ -n "${LOCKSTEP_BIN:-}" ]]; then
        [[ -x "$LOCKSTEP_BIN" ]] || die "LOCKSTEP_BIN=$LOCKSTEP_BIN is not an executable"
        LOCKSTEP="$LOCKSTEP_BIN"
        log "lockstep: $LOCKSTEP (from LOCKSTEP_BIN, not rebuilt)"
        return 0
    fi
    local target="${CARGO_TARGET_DIR:-$REPO/target}"
    [[ "$target" == /* ]] || target="$REPO/$target"
    LOCKSTEP="$target/release/lockstep"
    # A stale binary would compare old code: rebuild when anything cargo would look at is newer.
    if [[ ! -x "$LOCKSTEP" ]] || [[ -n "$(find "$REPO/crates" "$REPO/Cargo.toml" "$REPO/Cargo.lock" \
            -newer "$LOCKSTEP" \( -name '*.rs' -o -name 'Cargo.toml' -o -name 'Cargo.lock' \) \
            -print -quit 2>/dev/null)" ]]; then
        command -v cargo >/dev/null || die "cargo not found: cannot build $LOCKSTEP"
        log "building lockstep (cargo build --release -p lockstep-cli, nice 10)"
        (cd "$REPO" && CARGO_TARGET_DIR="$target" nice -n 10 cargo build --release -p lockstep-cli) >&2 \
            || die "cargo build --release -p lockstep-cli failed$([[ -x "$LOCKSTEP" ]] \
                && echo "; to measure the existing (older) binary as is: LOCKSTEP_BIN=$LOCKSTEP")"
    fi
    [[ -x "$LOCKSTEP" ]] || die "no lockstep binary at $LOCKSTEP"
    log "lockstep: $LOCKSTEP"
}

# Prints the cached file of model $1 as `lockstep models` reports it ("" when not listed), and
# whether it is cached, as "STATUS<TAB>PATH".
lockstep_model_row() {
    "$LOCKSTEP" models | "$PYTHON" -c '
import re, sys
name = sys.argv[1]
for line in sys.stdin:
    # NAME  SIZE  STATUS  PATH; SIZE ("93.81 MiB") and STATUS ("not pulled") contain spaces.
    m = re.match(r"^(\S+)\s+.*?\s+(cached|not pulled)\s+(\S.*)$", line.rstrip("\n"))
    if m and m.group(1) == name:
        print(m.group(2) + "\t" + m.group(3))
        name = None  # keep reading: never close the pipe on lockstep early
' "$1"
}

# Prints the .gguf path of model $1: a file path as is; a name through lockstep (pulled when
# not cached). Without lockstep (--llama-only and no binary) the cache layout is used.
resolve_model() {
    local m="$1" row status path
    if [[ "$m" == *.gguf || "$m" == */* ]]; then
        [[ -f "$m" ]] || die "model file $m not found"
        (cd "$(dirname "$m")" && echo "$PWD/$(basename "$m")")
        return 0
    fi
    if [[ -z "${LOCKSTEP:-}" ]]; then
        path="$CACHE_ROOT/models/$m.gguf"
        [[ -f "$path" ]] || die "$path not found (run: lockstep pull $m)"
        echo "$path"
        return 0
    fi
    row="$(lockstep_model_row "$m")"
    [[ -n "$row" ]] || die "'$m' is not a model lockstep knows (see: $LOCKSTEP models)"
    status="${row%%$'\t'*}"
    path="${row#*$'\t'}"
    if [[ "$status" != cached ]]; then
        log "pulling $m"
        "$LOCKSTEP" pull "$m" >&2 || die "lockstep pull $m failed"
    fi
    [[ -f "$path" ]] || die "lockstep reports $path for $m but there is no such file"
    echo "$path"
}

# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

build_peer
if [[ "$LLAMA_ONLY" == 0 ]]; then
    build_lockstep
    "$LOCKSTEP" bench --help >/dev/null 2>&1 || die "$LOCKSTEP has no working 'bench' subcommand"
fi
if [[ "$BUILD_ONLY" == 1 ]]; then
    exit 0
fi

# MODEL_LIST holds one key per model: its name, or for a path the file name without .gguf
# (keys name the raw files, so they must not contain '/'); MODEL_PATH maps key -> file.
IFS=',' read -r -a MODEL_ARGS <<<"$MODELS"
[[ ${#MODEL_ARGS[@]} -gt 0 ]] || die "--models is empty"
MODEL_LIST=()
declare -A MODEL_PATH=()
for m in "${MODEL_ARGS[@]}"; do
    [[ -n "$m" ]] || die "--models has an empty entry"
    key="$(basename "$m" .gguf)"
    [[ -z "${MODEL_PATH[$key]:-}" ]] || die "model $key given twice"
    MODEL_PATH["$key"]="$(resolve_model "$m")"
    MODEL_LIST+=("$key")
    log "model $key: ${MODEL_PATH[$key]}"
done

STAMP="$(date +%Y%m%d-%H%M%S)"
RESULTS_DIR="$REPO/target/bench"
RAW="$RESULTS_DIR/compare-$STAMP"
mkdir -p "$RAW"
[[ -n "$OUT_MD" ]] || OUT_MD="$RESULTS_DIR/compare-$STAMP.md"
mkdir -p "$(dirname "$OUT_MD")"

# ggml's system-info line ("CPU : SSE3 = 1 | AVX = 1 | ... | OPENMP = 1 | REPACK = 1 |"), from
# llama-completion's startup log on the first model (one token; best effort).
SYSINFO=""
if [[ -x "${LLAMA_COMPLETION:-}" ]]; then
    SYSINFO="$(timeout 120 "$LLAMA_COMPLETION" -m "${MODEL_PATH[${MODEL_LIST[0]}]}" -t "$THREADS" -p hi -n 1 \
        --no-warmup -no-cnv </dev/null 2>&1 | grep -m1 'system_info' | sed 's/^.*system_info: *//' || true)"
fi
# The compiler flags ggml's CPU backend was built with (from the configure log).
CPU_VARIANT=""
CMAKE_FLAGS_USED="(external build: LLAMA_BENCH=$LLAMA_BENCH)"
if [[ "$LLAMA_BENCH" == "$BUILD_DIR/bin/llama-bench" && -f "$BUILD_DIR/configure.log" ]]; then
    CMAKE_FLAGS_USED="$(cmake_flags | tr '\n' ' ')"
    CPU_VARIANT="$(grep -m1 'Adding CPU backend variant' "$BUILD_DIR/configure.log" | sed 's/^-- //' || true)"
fi

# Writes the whole run's metadata for the report (values passed through the environment, so
# quotes or backslashes in them cannot break the Python).
META_CMAKE_FLAGS="$CMAKE_FLAGS_USED" \
META_CPU_VARIANT="$CPU_VARIANT" META_SYSINFO="$SYSINFO" \
META_CPU_MODEL="$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | sed 's/.*: //' || true)" \
META_NPROC="$(nproc 2>/dev/null || echo '?')" \
META_GIT="$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$REPO" diff --quiet 2>/dev/null || echo '+dirty')" \
META_MODELS="$(printf '%s\n' "${MODEL_LIST[@]}")" \
META_STAMP="$STAMP" META_THREADS="$THREADS" META_REPS="$REPS" META_ROUNDS="$ROUNDS" \
META_N_PROMPT="$N_PROMPT" META_N_GEN="$N_GEN" META_OPENMP="$OPENMP" META_ISA="$ISA" \
META_HAS512="$(has_flag avx512f && echo 1 || echo 0)" \
META_SIMD_FLAGS="$(tr ' ' '\n' <<<"$CPU_FLAGS" | grep -E '^(avx|fma|f16c|bmi2|amx)' | tr '\n' ' ' | sed 's/ $//')" \
META_LLAMA_BENCH="$LLAMA_BENCH" META_LOCKSTEP="${LOCKSTEP:-}" \
META_VERSION="$LLAMA_CPP_PYTHON_VERSION" \
META_OMP_ENV="$(env | grep -E '^(OMP_|GOMP_)' | sort | tr '\n' ' ' || true)" \
"$PYTHON" - "$RAW/meta.json" <<'EOF'
import json, os, sys
e = os.environ
json.dump({
    "stamp": e["META_STAMP"],
    "threads": int(e["META_THREADS"]), "reps": int(e["META_REPS"]),
    "rounds": int(e["META_ROUNDS"]),
    "n_prompt": int(e["META_N_PROMPT"]), "n_gen": int(e["META_N_GEN"]),
    "openmp": e["META_OPENMP"],
    "isa": e["META_ISA"],
    "cpu_has_avx512": e["META_HAS512"],
    "cpu_simd_flags": e["META_SIMD_FLAGS"],
    "llama_bench": e["META_LLAMA_BENCH"],
    "lockstep": e["META_LOCKSTEP"],
    "llama_cpp_python": e["META_VERSION"],
    "cmake_flags": e["META_CMAKE_FLAGS"],
    "cpu_variant": e["META_CPU_VARIANT"],
    "system_info": e["META_SYSINFO"],
    "cpu_model": e["META_CPU_MODEL"],
    "nproc": e["META_NPROC"],
    "lockstep_git": e["META_GIT"],
    "models": [m for m in e["META_MODELS"].split("\n") if m],
    "omp_env": e["META_OMP_ENV"].strip(),
}, open(sys.argv[1], "w"), indent=1)
EOF

loadavg() { cut -d' ' -f1-3 /proc/loadavg; }

# One engine run: $1 = engine (llama|lockstep), $2 = model key, $3 = round. Writes
# $RAW/<engine>-<model>-r<round>.json and a .load file (load average before/after). A failing
# invocation (e.g. an architecture lockstep does not support yet) does not stop the run: its
# JSON is an empty list and a .failed file keeps the last line of its stderr for the report.
run_engine() {
    local engine="$1" m="$2" round="$3" file="${MODEL_PATH[$2]}"
    local stem="$RAW/$engine-$m-r$round"
    local before rc=0
    before="$(loadavg)"
    log "round $round/$ROUNDS  $engine  $m  (load $before)"
    # Peak RSS of the invocation (GNU time's %M, KiB) where /usr/bin/time exists.
    local timer=()
    [[ -x /usr/bin/time ]] && timer=(/usr/bin/time -f %M -o "$stem.rss")
    case "$engine" in
        llama)
            "${timer[@]}" "$LLAMA_BENCH" -m "$file" -t "$THREADS" -p "$N_PROMPT" -n "$N_GEN" -r "$REPS" -o json \
                >"$stem.json" 2>"$stem.log" || rc=$? ;;
        lockstep)
            "${timer[@]}" "${LOCKSTEP_ISA_ENV[@]}" "$LOCKSTEP" bench -m "$file" --threads "$THREADS" -p "$N_PROMPT" -n "$N_GEN" -r "$REPS" \
                --output json >"$stem.json" 2>"$stem.log" || rc=$? ;;
    esac
    printf '%s\n%s\n' "$before" "$(loadavg)" >"$stem.load"
    if [[ "$rc" != 0 ]]; then
        log "warning: $engine failed on $m (exit $rc; log: $stem.log):"
        tail -n 3 "$stem.log" >&2
        grep -v '^[[:space:]]*$' "$stem.log" | tail -n 1 >"$stem.failed" || true
        echo '[]' >"$stem.json"
        FAILURES=$((FAILURES + 1))
    fi
}

FAILURES=0
for ((round = 1; round <= ROUNDS; round++)); do
    for m in "${MODEL_LIST[@]}"; do
        if [[ "$LLAMA_ONLY" == 1 ]]; then
            run_engine llama "$m" "$round"
        elif ((round % 2 == 1)); then
            run_engine llama "$m" "$round"
            run_engine lockstep "$m" "$round"
        else
            run_engine lockstep "$m" "$round"
            run_engine llama "$m" "$round"
        fi
    done
done

# Merge the raw JSON into the report (stdout and $OUT_MD).
"$PYTHON" - "$RAW" "$OUT_MD" <<'EOF'
import glob, json, math, os, statistics, sys

raw, out_md = sys.argv[1], sys.argv[2]
meta = json.load(open(os.path.join(raw, "meta.json")))

def test_name(n_prompt, n_gen):
    if n_prompt and not n_gen:
        return f"pp{n_prompt}"
    if n_gen and not n_prompt:
        return f"tg{n_gen}"
    return f"pp{n_prompt}+tg{n_gen}"

# samples[(model, test)][engine] = list of per-round lists of t/s samples
samples = {}
failures = {}  # (model, engine) -> last stderr line
tests_wanted = ([f"pp{meta['n_prompt']}"] if meta["n_prompt"] else []) + \
               ([f"tg{meta['n_gen']}"] if meta["n_gen"] else [])
peer_info = {}
loads = []
bw = {}   # model -> {"bytes": weight bytes read per decode token, "gbs": [bandwidths]}
rss = {}  # (model, engine) -> [peak RSS bytes per invocation]
for path in sorted(glob.glob(os.path.join(raw, "*-r*.json"))):
    stem = os.path.basename(path)[: -len(".json")]
    engine, rest = stem.split("-", 1)
    model, rnd = rest.rsplit("-r", 1)
    with open(path) as f:
        rows = json.load(f)
    for row in rows:
        if engine == "llama":
            test = test_name(row.get("n_prompt", 0), row.get("n_gen", 0))
            ts = row.get("samples_ts") or [row["avg_ts"]]
            for k in ("build_commit", "build_number", "cpu_info", "backends", "n_batch",
                      "n_ubatch", "type_k", "type_v", "flash_attn", "poll", "repack"):
                if k in row:
                    peer_info.setdefault(k, row[k])
        else:
            test = row["test"]
            ts = row.get("samples_ts") or [row["tokens_per_second"]]
            if row.get("bytes_per_token") and row.get("bandwidth_gbs"):
                bw.setdefault(model, {"bytes": row["bytes_per_token"], "gbs": []})
                bw[model]["gbs"].append(float(row["bandwidth_gbs"]))
            for k in ("kernels", "kv_type"):
                if k in row:
                    peer_info.setdefault("lockstep_" + k, row[k])
        samples.setdefault((model, test), {}).setdefault(engine, []).append([float(x) for x in ts])
    failed_file = os.path.join(raw, stem + ".failed")
    if os.path.exists(failed_file):
        reason = open(failed_file).read().strip() or "failed"
        failures.setdefault((model, engine), reason)
        for t in tests_wanted:
            samples.setdefault((model, t), {}).setdefault(engine, [])
    rss_file = os.path.join(raw, stem + ".rss")
    if os.path.exists(rss_file):
        try:
            kib = int(open(rss_file).read().split()[-1])
            rss.setdefault((model, engine), []).append(kib * 1024)
        except (ValueError, IndexError):
            pass
    load_file = os.path.join(raw, stem + ".load")
    if os.path.exists(load_file):
        loads.append(float(open(load_file).read().split()[0]))

def mean_sd(rounds):
    flat = [x for r in rounds for x in r]
    if not flat:
        return None, None
    return statistics.fmean(flat), (statistics.stdev(flat) if len(flat) > 1 else 0.0)

lines = []
lines.append(f"# lockstep vs llama.cpp — {meta['stamp']}")
lines.append("")
lines.append(f"- machine: {meta['cpu_model']}, {meta['nproc']} logical CPUs; "
             f"load average (1 min) during the runs: "
             + (f"min {min(loads):.2f}, max {max(loads):.2f}" if loads else "?"))
isa = meta.get("isa", "?")
native512 = meta.get("cpu_has_avx512") == "1"
lines.append(f"- instruction set of both engines: {isa}"
             + (" (**AVX2 forced on an AVX-512 machine**: peer built without AVX-512, "
                "lockstep with LOCKSTEP_KERNELS=avx2 LOCKSTEP_CPU_ISA=avx2)" if isa == "avx2" and native512 else "")
             + f"; CPU flags: {meta.get('cpu_simd_flags', '?')}")
try:
    ncpu = int(meta["nproc"])
except ValueError:
    ncpu = 0
if loads and ncpu and max(loads) > ncpu:
    lines.append(f"- **warning: the machine was oversubscribed (load up to {max(loads):.1f} on {ncpu} "
                 f"CPUs).** With more than one thread, preempted threads stall every barrier, so the "
                 f"numbers (tg above all) measure waiting under contention more than kernels; "
                 f"compare with --threads 1 too.")
lines.append(f"- settings: threads {meta['threads']}, pp{meta['n_prompt']} / tg{meta['n_gen']}, "
             f"{meta['reps']} repetitions per invocation, {meta['rounds']} alternating round(s) (ABBA)")
lines.append(f"- llama.cpp: llama-cpp-python=={meta['llama_cpp_python']} vendored llama.cpp, build "
             f"{peer_info.get('build_commit', '?')} ({peer_info.get('build_number', '?')}), "
             f"backends {peer_info.get('backends', '?')}, cpu_info \"{peer_info.get('cpu_info', '?')}\"")
lines.append(f"  - llama-bench defaults: n_batch {peer_info.get('n_batch', '?')}, n_ubatch "
             f"{peer_info.get('n_ubatch', '?')}, type_k/v {peer_info.get('type_k', '?')}/"
             f"{peer_info.get('type_v', '?')}, flash_attn {peer_info.get('flash_attn', '?')}, "
             f"poll {peer_info.get('poll', '?')}, repack {peer_info.get('repack', '?')}")
lines.append(f"  - system_info: {meta['system_info'] or '?'}")
lines.append(f"  - OpenMP environment: {meta['omp_env'] or '(none: libgomp defaults)'}")
lines.append(f"  - {meta['cpu_variant'] or 'CPU backend flags: ?'}")
lines.append(f"  - cmake: {meta['cmake_flags'].strip()}")
if meta.get("lockstep"):
    lines.append(f"- lockstep: {meta['lockstep']} (git {meta['lockstep_git']}), kernels "
                 f"{peer_info.get('lockstep_kernels', '?')}, kv {peer_info.get('lockstep_kv_type', '?')}")
lines.append("")
lines.append("| model | test | llama.cpp t/s | lockstep t/s | lockstep/llama.cpp | per-round ratios |")
lines.append("| --- | --- | ---: | ---: | ---: | --- |")

def order_key(key):
    model, test = key
    return (meta["models"].index(model) if model in meta["models"] else 99, test[:2] != "pp", test)

for key in sorted(samples, key=order_key):
    model, test = key
    eng = samples[key]
    lm, ls = mean_sd(eng.get("llama", []))
    km, ks = mean_sd(eng.get("lockstep", []))
    def fmt(m, s, engine):
        if m is not None:
            return f"{m:.2f} ± {s:.2f}"
        return "failed" if (model, engine) in failures else "—"
    ratio = "—" if (lm is None or km is None or lm == 0) else f"**{km / lm:.2f}**"
    per_round = []
    for a, b in zip(eng.get("llama", []), eng.get("lockstep", [])):
        if a and b and statistics.fmean(a) > 0:
            per_round.append(f"{statistics.fmean(b) / statistics.fmean(a):.2f}")
    lines.append(f"| {model} | {test} | {fmt(lm, ls, 'llama')} | {fmt(km, ks, 'lockstep')} | {ratio} | "
                 f"{', '.join(per_round) or '—'} |")
lines.append("")
if bw:
    lines.append("Decode against the memory-bandwidth bound (read bandwidth measured by `lockstep "
                 "bench` in each of its invocations, same threads; bound = bandwidth ÷ weight bytes "
                 "read per token):")
    lines.append("")
    lines.append("| model | weights read per token | read bandwidth GB/s | bound t/s | llama.cpp | lockstep |")
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: |")
    for model in sorted(bw, key=lambda m: meta["models"].index(m) if m in meta["models"] else 99):
        b = bw[model]["bytes"]
        g = statistics.median(bw[model]["gbs"])
        bound = g * 1e9 / b
        tg = [k for k in samples if k[0] == model and k[1].startswith("tg")]
        cells = []
        for engine in ("llama", "lockstep"):
            m = mean_sd(samples[tg[0]].get(engine, []))[0] if tg else None
            cells.append("—" if m is None else f"{100 * m / bound:.0f}%")
        lines.append(f"| {model} | {b / 2**20:.1f} MiB | {g:.1f} | {bound:.1f} | {cells[0]} | {cells[1]} |")
    lines.append("")
if rss:
    lines.append("Peak RSS per invocation (GNU time, max over rounds):")
    lines.append("")
    lines.append("| model | llama.cpp | lockstep |")
    lines.append("| --- | ---: | ---: |")
    for model in meta["models"]:
        cells = [f"{max(rss[(model, e)]) / 2**20:.0f} MiB" if (model, e) in rss else "—"
                 for e in ("llama", "lockstep")]
        lines.append(f"| {model} | {cells[0]} | {cells[1]} |")
    lines.append("")
lines.append("t/s: mean ± standard deviation over all repetitions of all rounds. "
             "Ratio > 1: lockstep is faster. The machine is shared: compare ratios, "
             "not absolute numbers across runs.")
for (model, engine), reason in sorted(failures.items()):
    who = "llama.cpp" if engine == "llama" else "lockstep"
    lines.append(f"- {who} failed on {model}: `{reason}`")
lines.append(f"Raw JSON: {raw}")
text = "\n".join(lines) + "\n"
sys.stdout.write(text)
with open(out_md, "w") as f:
    f.write(text)
EOF
log "report written to $OUT_MD"
if [[ "$FAILURES" != 0 ]]; then
    log "$FAILURES invocation(s) failed (see the report)"
    exit 2
fi
