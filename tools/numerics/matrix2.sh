#!/bin/bash
# Second queue: qwen2.5-coder-0.5b self-variation, then smollm2 FA off + KV f32.
cd /work/main/target-numerics
M=~/.cache/lockstep/models; C="$(dirname "$0")/cmp.py"; G="$(dirname "$0")/../../crates/model/tests/data/golden"
run() { m=$1; tag=$2; shift 2; ./lpdump $M/$m.gguf $m.cases $tag.txt "$@" && echo "$tag ($*): vs golden $(python3 $C $G/$m.json $tag.txt)"; }
while kill -0 32557 2>/dev/null; do sleep 5; done
echo "s_norepack: vs golden $(python3 $C $G/smollm2-135m.json s_norepack.txt)"
run qwen2.5-coder-0.5b q_def
run qwen2.5-coder-0.5b q_norepack --norepack
run qwen2.5-coder-0.5b q_tf --mode tf
run qwen2.5-coder-0.5b q_fa0 --fa 0
run smollm2-135m s_fa0kv32 --fa 0 --kv f32
