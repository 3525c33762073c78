#!/bin/bash
# llama.cpp against itself: one setting changed at a time. Output: target-numerics/<tag>.txt
cd /work/main/target-numerics
M=~/.cache/lockstep/models; C="$(dirname "$0")/cmp.py"; G="$(dirname "$0")/../../crates/model/tests/data/golden"
run() { m=$1; tag=$2; shift 2; ./lpdump $M/$m.gguf $m.cases $tag.txt "$@" && echo "$tag ($*): vs golden $(python3 $C $G/$m.json $tag.txt)"; }
run smollm2-135m s_fa0 --fa 0
run smollm2-135m s_fa1 --fa 1
run smollm2-135m s_kv32 --kv f32
run smollm2-135m s_t1 --threads 1
run smollm2-135m s_tf --mode tf
run smollm2-135m s_norepack --norepack
run smollm2-135m s_fa0kv32 --fa 0 --kv f32
run qwen2.5-coder-0.5b q_def
run qwen2.5-coder-0.5b q_fa0 --fa 0
run qwen2.5-coder-0.5b q_kv32 --kv f32
run qwen2.5-coder-0.5b q_tf --mode tf
run qwen2.5-coder-0.5b q_norepack --norepack
