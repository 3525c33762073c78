#!/usr/bin/env bash
# llama.cpp against itself on the committed golden references: the reference settings
# (defaults, which must reproduce the file), then flash attention off, then the whole
# sequence as one batch (teacher-forced). Prints cmp.py's max / mean per run: the noise
# floor that bounds the teacher-forced tests of crates/model/tests/golden_*.rs.
#   usage: tools/numerics/selfvar.sh GOLDEN_NAME [MODEL]   e.g. smollm2-135m, long-gemma3-270m
# Needs the peer built by bench/compare.sh and the venv of tools/golden/make.py (gguf-py +
# numpy); outputs go to target/numerics/.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
NAME="$1"; MODEL="${2:-${NAME#long-}}"; MODEL="${MODEL%-nobos}"
CACHE="${LOCKSTEP_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/lockstep}"
P="$CACHE/peers/llama.cpp-0.3.36"; V="$P/src/llama_cpp_python-0.3.36/vendor/llama.cpp"
PY="$CACHE/peers/golden-venv/bin/python"
G="$REPO/crates/model/tests/data/golden/$NAME.json"
OUT="$REPO/target/numerics"; mkdir -p "$OUT"
if [[ ! -x "$OUT/lpdump" || "$REPO/tools/numerics/lpdump.cpp" -nt "$OUT/lpdump" ]]; then
    g++ -O2 -std=c++17 "$REPO/tools/numerics/lpdump.cpp" -I"$V/include" -I"$V/ggml/include" -o "$OUT/lpdump" \
        "$P/build/src/libllama.a" "$P/build/ggml/src/libggml.a" "$P/build/ggml/src/libggml-cpu.a" \
        "$P/build/ggml/src/libggml-base.a" -fopenmp -lpthread -ldl
fi
"$PY" "$REPO/tools/numerics/mkcases.py" "$G" "$CACHE/models/$MODEL.gguf" >"$OUT/$NAME.cases"
export OMP_WAIT_POLICY=passive
for run in "default:" "fa0:--fa 0" "tf:--mode tf"; do
    tag="${run%%:*}"; read -r -a flags <<<"${run#*:}"
    "$OUT/lpdump" "$CACHE/models/$MODEL.gguf" "$OUT/$NAME.cases" "$OUT/$NAME.$tag.txt" "${flags[@]}"
    echo "$NAME $tag (${run#*:}): $(python3 "$REPO/tools/numerics/cmp.py" "$G" "$OUT/$NAME.$tag.txt")"
done
