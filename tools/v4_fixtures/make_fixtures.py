#!/usr/bin/env python3
"""Tiny random-weight DeepSeek V4 reference fixtures for lockstep (issue #11, item 1).

Builds small DeepSeek V4 checkpoints with the PyPI `transformers` implementation
(`transformers.models.deepseek_v4`, class `DeepseekV4ForCausalLM`, config class
`DeepseekV4Config`, model_type "deepseek_v4"), converts each to a GGUF with the tensor names
and metadata keys of llama.cpp's `deepseek4` conversion, and records reference logits (f32)
from the transformers forward for fixed token sequences.

What this follows (read, not copied):
  * llama.cpp (ggml-org/llama.cpp) commit 01a723dc630d075780ac7081fd63fbd87780f665,
    file conversion/deepseek.py, class DeepseekV4Model: `set_gguf_parameters` (metadata keys),
    `_map_tensor_name_deepseek4` (tensor names), `_write_deepseek4_tid2eid_tensors` (I32 hash
    table), expert merge (w1/w3/w2 stacked per layer), plus the generic
    conversion/base.py TextModel rules (1-D tensors, `*_norm.weight`, `ffn_gate_inp` and
    non-`.weight` tensors stay F32; other tensors take the out type, F16 here).
  * The string values of the gguf-py `MODEL_TENSOR` / `Keys` constants that those names resolve
    to (gguf-py/gguf/constants.py of a llama.cpp tree with MODEL_ARCH.DEEPSEEK4 = "deepseek4").
    The PyPI `gguf` package pinned below predates DEEPSEEK4, so the names and keys are spelled
    out in `GGUF_NAMES` / `write_gguf` below and the file is written with the generic writer.
  * transformers' own `conversion_mapping.py` entry "deepseek_v4" (original DeepSeek checkpoint
    names <-> transformers module names); `check_original_names` proves the inverse used here by
    loading an original-format safetensors export back through `from_pretrained`.

Pinned: Python 3.12, torch 2.15.0 (CPU use), transformers 5.25.0 (installed --no-deps: its
`kernels` requirement is not needed for the eager CPU path), gguf 0.19.0, numpy 2.x,
safetensors 0.8.0. See README.md beside this file.

Run:  python make_fixtures.py [--out DIR]   (default: crates/model/tests/fixtures/deepseek4)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

import gguf
import transformers
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.cache_utils import DynamicCache
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl

LLAMA_CPP_COMMIT = "01a723dc630d075780ac7081fd63fbd87780f665"
LLAMA_CPP_FILE = "conversion/deepseek.py (class DeepseekV4Model)"
ARCH = "deepseek4"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "crates" / "model" / "tests" / "fixtures" / "deepseek4"

# Vocabulary: two specials and the 256 byte tokens of a GPT-2 byte-level BPE with no merges.
BOS_ID, EOS_ID = 0, 1
SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
VOCAB = len(SPECIALS) + 256


# --------------------------------------------------------------------------------------------
# Fixture definitions
# --------------------------------------------------------------------------------------------

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
RATIO_OF = {SWA: 0}

FIXTURES = [
    {
        # Flash's layer plan in miniature: two sliding-window layers, then CSA (ratio 4, with the
        # indexer) and HCA (ratio 128) interleaved; hash routing on the first 3 layers; the real
        # YaRN parameters on the compressed layers' rope; real sinkhorn/eps/scaling/limit values.
        "name": "flash-layout",
        "seed": 1234,
        "config": dict(
            hidden_size=64,
            moe_intermediate_size=32,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            partial_rotary_factor=8 / 32,
            q_lora_rank=32,
            o_groups=2,
            o_lora_rank=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            scoring_func="sqrtsoftplus",
            norm_topk_prob=True,
            routed_scaling_factor=1.5,
            layer_types=[SWA, SWA, CSA, HCA, CSA, HCA],
            mlp_layer_types=["hash_moe", "hash_moe", "hash_moe", "moe", "moe", "moe"],
            compress_rates={CSA: 4, HCA: 128},
            rope_theta=10000.0,
            compress_rope_theta=160000.0,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 16.0,
                "original_max_position_embeddings": 65536,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
            hc_mult=4,
            hc_sinkhorn_iters=20,
            hc_eps=1e-6,
            swiglu_limit=10.0,
            sliding_window=32,
            index_n_heads=8,
            index_head_dim=16,
            index_topk=16,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
        ),
        "seq_lens": [300, 160, 9],
    },
    {
        # Other shapes and a lower HCA ratio (16) so the high-ratio compressor emits many rows;
        # the layer kinds in another order (compressed layer first, sliding layer between);
        # plain (non-YaRN) compressed rope; a low swiglu limit so the routed and shared expert
        # clamps are both exercised; 3 experts per token of 6; 3 output groups.
        "name": "small-ratios",
        "seed": 99,
        "config": dict(
            hidden_size=48,
            moe_intermediate_size=24,
            num_hidden_layers=4,
            num_attention_heads=6,
            num_key_value_heads=1,
            head_dim=16,
            partial_rotary_factor=8 / 16,
            q_lora_rank=24,
            o_groups=3,
            o_lora_rank=8,
            n_routed_experts=6,
            num_experts_per_tok=3,
            n_shared_experts=1,
            scoring_func="sqrtsoftplus",
            norm_topk_prob=True,
            routed_scaling_factor=2.0,
            layer_types=[CSA, HCA, SWA, CSA],
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
            compress_rates={CSA: 4, HCA: 16},
            rope_theta=10000.0,
            compress_rope_theta=40000.0,
            hc_mult=4,
            hc_sinkhorn_iters=20,
            hc_eps=1e-6,
            swiglu_limit=1.5,
            sliding_window=24,
            index_n_heads=8,
            index_head_dim=8,
            index_topk=12,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
        ),
        "seq_lens": [280, 97, 5],
    },
]


# --------------------------------------------------------------------------------------------
# Model construction
# --------------------------------------------------------------------------------------------


def make_config(spec: dict) -> DeepseekV4Config:
    c = dict(spec["config"])
    cfg = DeepseekV4Config(
        vocab_size=VOCAB,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=None,
        tie_word_embeddings=False,
        num_nextn_predict_layers=0,
        attention_dropout=0.0,
        **c,
    )
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def stored_as_f16(gguf_name: str, ndim: int) -> bool:
    """llama.cpp's TextModel rule for `--outtype f16` (see module doc)."""
    if ndim <= 1 or gguf_name.endswith("_norm.weight"):
        return False
    if ".ffn_gate_inp." in gguf_name or not gguf_name.endswith(".weight"):
        return False
    if ".ffn_gate_tid2eid." in gguf_name:
        return False
    return True


@torch.no_grad()
def init_weights(model: DeepseekV4ForCausalLM, cfg: DeepseekV4Config, gen: torch.Generator) -> None:
    """Random weights scaled so activations stay O(1) and every branch carries signal."""

    def normal(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * std + mean)

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("embed_tokens.weight"):
            normal(p, 1.0)
        elif name.endswith("norm.weight"):  # every weighted RMSNorm
            normal(p, 0.1, 1.0)
        elif leaf == "sinks":
            normal(p, 1.0)
        elif leaf == "position_bias":
            normal(p, 0.5)
        elif leaf in ("fn", "hc_fn"):  # HC projections act on an RMS-normalised hc*D vector
            normal(p, 1.0 / math.sqrt(p.shape[1]))
        elif leaf in ("base", "hc_base"):
            normal(p, 0.5)
        elif leaf in ("scale", "hc_scale"):
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        elif name.endswith("experts.gate_up_proj"):
            normal(p, 1.0 / math.sqrt(p.shape[2]))
        elif name.endswith("experts.down_proj"):
            normal(p, 1.0 / math.sqrt(p.shape[2]))
        elif name.endswith("lm_head.weight"):
            normal(p, 2.0 / math.sqrt(p.shape[1]))
        elif p.ndim == 2:  # nn.Linear weights and the router weight: [out, in]
            normal(p, 1.0 / math.sqrt(p.shape[1]))
        else:
            raise RuntimeError(f"no init rule for parameter {name} {tuple(p.shape)}")
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            normal(b, 0.3)
        elif name.endswith("tid2eid"):
            rows = [torch.randperm(cfg.n_routed_experts, generator=gen)[: cfg.num_experts_per_tok] for _ in range(b.shape[0])]
            b.copy_(torch.stack(rows).to(b.dtype))
    # Round every tensor the GGUF stores as F16, so the GGUF holds exactly the reference weights.
    for hf_name, tensor in model.state_dict(keep_vars=True).items():
        if hf_name.endswith("inv_freq"):
            continue
        for gname, view in gguf_views(hf_name, tensor, cfg):
            if stored_as_f16(gname, view.ndim):
                view.copy_(view.half().float())


# --------------------------------------------------------------------------------------------
# Names: transformers -> original DeepSeek checkpoint -> llama.cpp GGUF
# --------------------------------------------------------------------------------------------

# Original DeepSeek V4 checkpoint name (what llama.cpp's converter reads) -> GGUF base name,
# as `DeepseekV4Model._map_tensor_name_deepseek4` resolves it (TENSOR_NAMES strings + suffix).
GGUF_TOP = {
    "embed.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "head.weight": "output.weight",
    "hc_head_base": "output_hc_base.weight",
    "hc_head_fn": "output_hc_fn.weight",
    "hc_head_scale": "output_hc_scale.weight",
}
GGUF_LAYER = {
    "hc_attn_base": "hc_attn_base.weight",
    "hc_attn_fn": "hc_attn_fn.weight",
    "hc_attn_scale": "hc_attn_scale.weight",
    "hc_ffn_base": "hc_ffn_base.weight",
    "hc_ffn_fn": "hc_ffn_fn.weight",
    "hc_ffn_scale": "hc_ffn_scale.weight",
    "attn.attn_sink": "attn_sinks.weight",
    "attn.wq_a.weight": "attn_q_a.weight",
    "attn.wq_b.weight": "attn_q_b.weight",
    "attn.q_norm.weight": "attn_q_a_norm.weight",
    "attn.wkv.weight": "attn_kv.weight",
    "attn.kv_norm.weight": "attn_kv_a_norm.weight",
    "attn.wo_a.weight": "attn_output_a.weight",
    "attn.wo_b.weight": "attn_output_b.weight",
    "attn.compressor.ape": "attn_compressor_ape.weight",
    "attn.compressor.wkv.weight": "attn_compressor_kv.weight",
    "attn.compressor.wgate.weight": "attn_compressor_gate.weight",
    "attn.compressor.norm.weight": "attn_compressor_norm.weight",
    "attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
    "attn.indexer.weights_proj.weight": "indexer.proj.weight",
    "attn.indexer.compressor.ape": "indexer_compressor_ape.weight",
    "attn.indexer.compressor.wkv.weight": "indexer_compressor_kv.weight",
    "attn.indexer.compressor.wgate.weight": "indexer_compressor_gate.weight",
    "attn.indexer.compressor.norm.weight": "indexer_compressor_norm.weight",
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn.shared_experts.w1.weight": "ffn_gate_shexp.weight",
    "ffn.shared_experts.w3.weight": "ffn_up_shexp.weight",
    "ffn.shared_experts.w2.weight": "ffn_down_shexp.weight",
    "ffn.gate.weight": "ffn_gate_inp.weight",
    "ffn.gate.bias": "exp_probs_b.bias",
    "ffn.gate.tid2eid": "ffn_gate_tid2eid.weight",
    "ffn.experts.w1.weight": "ffn_gate_exps.weight",
    "ffn.experts.w3.weight": "ffn_up_exps.weight",
    "ffn.experts.w2.weight": "ffn_down_exps.weight",
}

# transformers module path suffix -> original checkpoint suffix (inverse of transformers'
# conversion_mapping "deepseek_v4").
HF_TO_ORIG_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
}
HF_TO_ORIG_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "head.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}


def orig_views(hf_name: str, t: torch.Tensor, cfg: DeepseekV4Config):
    """(original checkpoint name, tensor view) pairs for one transformers state-dict entry.
    The merged expert tensors come out as per-layer stacks `ffn.experts.w{1,3,2}.weight`
    ([n_expert, out, in], what llama.cpp's expert merge produces) rather than per expert."""
    if hf_name in HF_TO_ORIG_TOP:
        return [(HF_TO_ORIG_TOP[hf_name], t)]
    if not hf_name.startswith("model.layers."):
        raise KeyError(hf_name)
    rest = hf_name[len("model.layers."):]
    bid, suffix = rest.split(".", 1)
    pre = f"layers.{bid}."
    if suffix == "mlp.experts.gate_up_proj":
        inter = cfg.moe_intermediate_size
        return [(pre + "ffn.experts.w1.weight", t[:, :inter, :]), (pre + "ffn.experts.w3.weight", t[:, inter:, :])]
    if suffix == "mlp.experts.down_proj":
        return [(pre + "ffn.experts.w2.weight", t)]
    if suffix not in HF_TO_ORIG_LAYER:
        raise KeyError(hf_name)
    return [(pre + HF_TO_ORIG_LAYER[suffix], t)]


def orig_to_gguf(orig: str) -> str:
    if orig in GGUF_TOP:
        return GGUF_TOP[orig]
    _, bid, rest = orig.split(".", 2)
    return f"blk.{bid}.{GGUF_LAYER[rest]}"


def gguf_views(hf_name: str, t: torch.Tensor, cfg: DeepseekV4Config):
    return [(orig_to_gguf(o), v) for o, v in orig_views(hf_name, t, cfg)]


def iter_gguf_tensors(model, cfg):
    for hf_name, t in model.state_dict().items():
        if hf_name.endswith("inv_freq"):
            continue
        for gname, v in gguf_views(hf_name, t, cfg):
            yield hf_name, gname, v


# --------------------------------------------------------------------------------------------
# GGUF
# --------------------------------------------------------------------------------------------


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def compress_ratios(cfg: DeepseekV4Config) -> list[int]:
    return [0 if t == SWA else int(cfg.compress_rates[t]) for t in cfg.layer_types]


def num_hash_layers(cfg: DeepseekV4Config) -> int:
    n = 0
    for t in cfg.mlp_layer_types:
        if t != "hash_moe":
            break
        n += 1
    if any(t == "hash_moe" for t in cfg.mlp_layer_types[n:]):
        raise ValueError("llama.cpp's hash_layer_count needs the hash layers to lead")
    return n


def gguf_metadata(cfg: DeepseekV4Config, name: str) -> list[tuple[str, object, str]]:
    """(key, value, kind) in the order the llama.cpp converter writes them."""
    a = ARCH
    L = cfg.num_hidden_layers
    md: list[tuple[str, object, str]] = [
        ("general.name", name, "str"),
        # TextModel.set_gguf_parameters
        (f"{a}.block_count", L, "u32"),
        (f"{a}.context_length", cfg.max_position_embeddings, "u32"),
        (f"{a}.embedding_length", cfg.hidden_size, "u32"),
        (f"{a}.attention.head_count", cfg.num_attention_heads, "u32"),
        (f"{a}.attention.head_count_kv", cfg.num_key_value_heads, "u32"),
        (f"{a}.rope.freq_base", float(cfg.rope_theta), "f32"),
        (f"{a}.attention.layer_norm_rms_epsilon", float(cfg.rms_norm_eps), "f32"),
        (f"{a}.expert_used_count", cfg.num_experts_per_tok, "u32"),
        (f"{a}.attention.key_length", cfg.head_dim, "u32"),
        (f"{a}.attention.value_length", cfg.head_dim, "u32"),
        ("general.file_type", int(gguf.LlamaFileType.MOSTLY_F16), "u32"),
    ]
    comp = cfg.rope_parameters["compress"]
    if comp.get("rope_type") == "yarn":
        md += [
            (f"{a}.rope.scaling.type", "yarn", "str"),
            (f"{a}.rope.scaling.factor", float(comp["factor"]), "f32"),
            (f"{a}.rope.scaling.original_context_length", int(comp["original_max_position_embeddings"]), "u32"),
            (f"{a}.rope.scaling.yarn_beta_fast", float(comp.get("beta_fast", 32.0)), "f32"),
            (f"{a}.rope.scaling.yarn_beta_slow", float(comp.get("beta_slow", 1.0)), "f32"),
        ]
    md += [
        # DeepseekV4Model.set_gguf_parameters
        (f"{a}.vocab_size", cfg.vocab_size, "u32"),
        (f"{a}.rope.dimension_count", cfg.qk_rope_head_dim, "u32"),
        (f"{a}.attention.q_lora_rank", cfg.q_lora_rank, "u32"),
        (f"{a}.attention.output_lora_rank", cfg.o_lora_rank, "u32"),
        (f"{a}.attention.output_group_count", cfg.o_groups, "u32"),
        (f"{a}.attention.compress_ratios", compress_ratios(cfg), "arr"),
        (f"{a}.attention.compress_rope_freq_base", float(cfg.compress_rope_theta), "f32"),
        (f"{a}.expert_feed_forward_length", cfg.moe_intermediate_size, "u32"),
        (f"{a}.expert_count", cfg.n_routed_experts, "u32"),
        (f"{a}.expert_shared_count", cfg.n_shared_experts, "u32"),
        (f"{a}.expert_weights_scale", float(cfg.routed_scaling_factor), "f32"),
        (f"{a}.hash_layer_count", num_hash_layers(cfg), "u32"),
        (f"{a}.expert_weights_norm", bool(cfg.norm_topk_prob), "bool"),
        (f"{a}.swiglu_clamp_exp", [float(cfg.swiglu_limit)] * L, "arr"),
        (f"{a}.attention.sliding_window", cfg.sliding_window, "u32"),
        (f"{a}.attention.indexer.head_count", cfg.index_n_heads, "u32"),
        (f"{a}.attention.indexer.key_length", cfg.index_head_dim, "u32"),
        (f"{a}.attention.indexer.top_k", cfg.index_topk, "u32"),
        (f"{a}.nextn_predict_layers", cfg.num_nextn_predict_layers, "u32"),
        (f"{a}.hyper_connection.count", cfg.hc_mult, "u32"),
        (f"{a}.hyper_connection.sinkhorn_iterations", cfg.hc_sinkhorn_iters, "u32"),
        (f"{a}.hyper_connection.epsilon", float(cfg.hc_eps), "f32"),
    ]
    return md


def vocab_tokens() -> list[str]:
    table = bytes_to_unicode()
    return SPECIALS + [table[b] for b in range(256)]


def write_gguf(path: Path, model, cfg: DeepseekV4Config, name: str) -> list[dict]:
    w = gguf.GGUFWriter(str(path), arch=ARCH)
    for key, val, kind in gguf_metadata(cfg, name):
        if kind == "u32":
            w.add_uint32(key, int(val))
        elif kind == "f32":
            w.add_float32(key, float(val))
        elif kind == "bool":
            w.add_bool(key, bool(val))
        elif kind == "str":
            w.add_string(key, str(val))
        elif kind == "arr":
            w.add_array(key, list(val))
        else:
            raise ValueError(kind)
    # Tokenizer (set_vocab -> _set_vocab_gpt2 shape): byte-level BPE, no merges.
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(vocab_tokens())
    w.add_token_types([int(gguf.TokenType.CONTROL)] * len(SPECIALS) + [int(gguf.TokenType.NORMAL)] * 256)
    w.add_token_merges([])
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(True)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    listing = []
    for _hf, gname, t in iter_gguf_tensors(model, cfg):
        if gname.endswith("ffn_gate_tid2eid.weight"):
            arr = t.to(torch.int32).numpy()
        elif stored_as_f16(gname, t.ndim):
            arr = t.detach().to(torch.float16).numpy()
        else:
            arr = t.detach().to(torch.float32).numpy()
        arr = np.ascontiguousarray(arr)
        w.add_tensor(gname, arr)
        listing.append({"name": gname, "shape": list(arr.shape), "dtype": str(arr.dtype)})
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return listing


# --------------------------------------------------------------------------------------------
# Coverage probes
# --------------------------------------------------------------------------------------------


class Probe:
    """Forward hooks recording what each V4 branch did during a forward."""

    def __init__(self, model, cfg):
        self.cfg = cfg
        self.rows = {}  # (layer, kind) -> compressed rows emitted
        self.strict_subset_queries = {}  # layer -> #queries whose selection dropped causal rows
        self.max_selected = {}
        self.bias_changed = {}  # layer -> #tokens whose learned top-k differs without the bias
        self.clamp_routed = {}
        self.clamp_shared = {}
        self.hash_tokens = {}
        self.min_index_margin = {}  # layer -> smallest relative gap at the top-k boundary
        self.min_router_margin = {}  # layer -> smallest score gap at the top-k boundary
        self._scores = {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            comp = layer.self_attn.compressor
            if isinstance(comp, mdl.DeepseekV4HCACompressor):
                self.handles.append(comp.register_forward_hook(self._hca(i)))
            if isinstance(comp, mdl.DeepseekV4CSACompressor):
                self.handles.append(comp.register_forward_hook(self._csa(i)))
                self.handles.append(comp.indexer.scorer.register_forward_hook(self._scorer(i)))
                self.handles.append(comp.indexer.register_forward_hook(self._indexer(i, comp.indexer)))
            gate = layer.mlp.gate
            if isinstance(gate, mdl.DeepseekV4TopKRouter):
                self.handles.append(gate.register_forward_hook(self._router(i)))
            else:
                self.handles.append(layer.mlp.register_forward_hook(self._hash(i), with_kwargs=True))
            self.handles.append(layer.mlp.experts.register_forward_hook(self._experts(i, layer.mlp.experts)))
            self.handles.append(layer.mlp.shared_experts.register_forward_hook(self._shared(i, layer.mlp.shared_experts)))

    def close(self):
        for h in self.handles:
            h.remove()

    def _add(self, d, k, v):
        d[k] = d.get(k, 0) + v

    def _hca(self, i):
        def hook(mod, args, out):
            self.rows[(i, "hca")] = max(self.rows.get((i, "hca"), 0), out[0].shape[2])
        return hook

    def _csa(self, i):
        def hook(mod, args, out):
            self.rows[(i, "csa")] = max(self.rows.get((i, "csa"), 0), out[0].shape[2])
        return hook

    def _scorer(self, i):
        def hook(mod, args, out):
            self._scores[i] = out[0].detach()  # [S, T] indexer scores before causal masking
        return hook

    def _indexer(self, i, idx_mod):
        def hook(mod, args, out):
            position_ids = args[2]
            causal = ((position_ids + 1) // idx_mod.compress_rate)[0]  # rows query t may see
            scores = self._scores.pop(i)
            k = idx_mod.index_topk
            for t in range(scores.shape[0]):
                n = int(causal[t])
                if n > k:  # a real selection: the k-th and (k+1)-th best valid rows must not tie
                    v = scores[t, :n].sort(descending=True).values
                    rel = float((v[k - 1] - v[k]) / v.abs().max().clamp_min(1e-12))
                    self.min_index_margin[i] = min(self.min_index_margin.get(i, 1.0), rel)
            valid = (out[0] >= 0).sum(-1)  # rows the indexer kept for query t
            strict = int(((causal > valid) & (valid > 0)).sum())
            self._add(self.strict_subset_queries, i, strict)
            self.max_selected[i] = max(self.max_selected.get(i, 0), int(valid.max()) if valid.numel() else 0)
        return hook

    def _router(self, i):
        def hook(mod, args, out):
            _logits, _w, idx = out
            flat = args[0].reshape(-1, mod.hidden_dim)
            scores = mod.score_fn(torch.nn.functional.linear(flat, mod.weight))
            biased = (scores + mod.e_score_correction_bias).sort(dim=-1, descending=True).values
            gap = float((biased[:, mod.top_k - 1] - biased[:, mod.top_k]).min())
            self.min_router_margin[i] = min(self.min_router_margin.get(i, 1e9), gap)
            plain = torch.topk(scores, mod.top_k, dim=-1).indices.sort(-1).values
            self._add(self.bias_changed, i, int((plain != idx.sort(-1).values).any(-1).sum()))
        return hook

    def _hash(self, i):
        def hook(mod, args, kwargs, out):
            self._add(self.hash_tokens, i, int(kwargs["input_ids"].numel()))
        return hook

    def _experts(self, i, ex):
        def hook(mod, args, out):
            x, idx = args[0], args[1]
            n = 0
            for e in range(ex.num_experts):
                rows = (idx == e).any(-1)
                if rows.any():
                    gu = torch.nn.functional.linear(x[rows], ex.gate_up_proj[e])
                    g, u = gu.chunk(2, dim=-1)
                    n += int((g > ex.limit).sum() + (u.abs() > ex.limit).sum())
            self._add(self.clamp_routed, i, n)
        return hook

    def _shared(self, i, mlp):
        def hook(mod, args, out):
            x = args[0]
            g, u = mlp.gate_proj(x), mlp.up_proj(x)
            self._add(self.clamp_shared, i, int((g > mlp.limit).sum() + (u.abs() > mlp.limit).sum()))
        return hook


# --------------------------------------------------------------------------------------------
# Reference runs
# --------------------------------------------------------------------------------------------


def token_sequences(n_lens: list[int], seed: int) -> list[list[int]]:
    g = np.random.default_rng(seed)
    seqs = []
    for k, n in enumerate(n_lens):
        if k == 1:  # a repetitive one (a 23-token phrase repeated with a few edits)
            phrase = g.integers(2, VOCAB, size=23)
            body = np.resize(phrase, n - 1)
            edits = g.integers(0, n - 1, size=max(1, (n - 1) // 20))
            body[edits] = g.integers(2, VOCAB, size=edits.size)
        else:
            body = g.integers(2, VOCAB, size=n - 1)
        seqs.append([BOS_ID] + [int(x) for x in body])
    return seqs


@torch.no_grad()
def full_logits(model, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids], dtype=torch.long)
    return model(input_ids=x, use_cache=False).logits[0].float()


@torch.no_grad()
def chunked_logits(model, cfg, ids: list[int], chunks: list[int]) -> torch.Tensor:
    cache = DynamicCache(config=cfg)
    out, pos = [], 0
    sizes = list(chunks)
    while pos < len(ids):
        n = sizes.pop(0) if sizes else 1
        n = min(n, len(ids) - pos)
        x = torch.tensor([ids[pos : pos + n]], dtype=torch.long)
        out.append(model(input_ids=x, cache=cache, use_cache=True).logits[0].float())
        pos += n
    return torch.cat(out, dim=0)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    h.update(path.read_bytes())
    return h.hexdigest()


def hf_to_orig_state(model, cfg) -> dict[str, torch.Tensor]:
    """The model's weights under original DeepSeek checkpoint names, experts per expert."""
    out = {}
    for hf_name, t in model.state_dict().items():
        if hf_name.endswith("inv_freq"):
            continue
        for oname, v in orig_views(hf_name, t, cfg):
            if ".ffn.experts.w" in oname:
                bid_pre, wid = oname.split(".ffn.experts.")
                wid = wid.split(".")[0]
                for e in range(v.shape[0]):
                    out[f"{bid_pre}.ffn.experts.{e}.{wid}.weight"] = v[e].contiguous().clone()
            else:
                out[oname] = v.contiguous().clone()
    return out


@torch.no_grad()
def check_original_names(model, cfg, ids: list[int], ref: torch.Tensor) -> float:
    """Save the weights under the original DeepSeek names and load them through transformers'
    own conversion mapping: identical logits prove the name inverse (and the w1/w3 order)."""
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as d:
        cfg.save_pretrained(d)
        save_file(hf_to_orig_state(model, cfg), os.path.join(d, "model.safetensors"))
        m2 = DeepseekV4ForCausalLM.from_pretrained(
            d, dtype=torch.float32, attn_implementation="eager", use_kernels=False
        )
        m2.config._experts_implementation = "eager"
        m2.eval()
        got = full_logits(m2, ids)
    return float((got - ref).abs().max())


# A selection decided by a near-tie would flip under any other summation order (an f32 engine
# in another language, or this one with other shapes), so the fixtures only keep weights whose
# top-k decisions all clear these gaps (indexer: relative to the largest |score| of the query;
# router: absolute, on sqrt(softplus) scores of order 1).
MIN_INDEX_MARGIN = 5e-5
MIN_ROUTER_MARGIN = 5e-5
MAX_SEED_TRIES = 150


def candidate(spec: dict, seed: int):
    gen = torch.Generator().manual_seed(seed)
    cfg = make_config(spec)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    init_weights(model, cfg, gen)
    seqs = token_sequences(spec["seq_lens"], spec["seed"] + 1)
    probe = Probe(model, cfg)
    logits = [full_logits(model, s) for s in seqs]
    probe.close()
    im = min(probe.min_index_margin.values(), default=1.0)
    rm = min(probe.min_router_margin.values(), default=1e9)
    return cfg, model, seqs, logits, probe, im, rm


def build_fixture(spec: dict, out_dir: Path) -> dict:
    torch.manual_seed(spec["seed"])
    tried = []
    for seed in range(spec["seed"], spec["seed"] + MAX_SEED_TRIES):
        cfg, model, seqs, logits, probe, im, rm = candidate(spec, seed)
        tried.append((seed, im, rm))
        if im >= MIN_INDEX_MARGIN and rm >= MIN_ROUTER_MARGIN:
            break
    else:
        raise SystemExit(f"{spec['name']}: no weight seed clears the top-k margins: {tried}")
    name = spec["name"]
    print(f"{name}: weight seed {seed} (tried {len(tried)}), index margin {im:.2e}, router margin {rm:.2e}")

    # ---- coverage assertions -------------------------------------------------------------
    longest = max(len(s) for s in seqs)
    assert SWA in cfg.layer_types and CSA in cfg.layer_types and HCA in cfg.layer_types
    assert longest > cfg.sliding_window, "sliding window never slides"
    for i, t in enumerate(cfg.layer_types):
        if t == HCA:
            assert probe.rows.get((i, "hca"), 0) >= 2, f"layer {i}: HCA compressor emitted < 2 rows"
        if t == CSA:
            assert probe.rows.get((i, "csa"), 0) > cfg.index_topk, f"layer {i}: CSA rows do not exceed index_topk"
            assert probe.strict_subset_queries.get(i, 0) > 0, f"layer {i}: indexer never selected a strict subset"
            assert probe.max_selected.get(i, 0) == cfg.index_topk, f"layer {i}: indexer never filled top-k"
    hash_layers = [i for i, t in enumerate(cfg.mlp_layer_types) if t == "hash_moe"]
    learned = [i for i, t in enumerate(cfg.mlp_layer_types) if t == "moe"]
    assert hash_layers and learned
    assert all(probe.hash_tokens.get(i, 0) > 0 for i in hash_layers)
    assert any(probe.bias_changed.get(i, 0) > 0 for i in learned), "e_score_correction_bias never changed a selection"
    assert cfg.n_shared_experts == 1 and cfg.hc_mult > 1 and cfg.o_groups > 1
    assert all(torch.isfinite(l).all() for l in logits)
    for l in logits:  # non-degenerate: logits vary across the vocabulary and across positions
        assert float(l.std(dim=-1).min()) > 0.1
        assert float(l.std(dim=0).mean()) > 0.1

    # ---- the reference is self-consistent: chunked prefill + decode == one full forward -------
    chunk_plan = [37, 1, 1, 64, 5, 3, 90]  # irregular: windows straddle chunk boundaries
    chunk_err = 0.0
    for s, ref in zip(seqs, logits):
        got = chunked_logits(model, cfg, s, chunk_plan)
        chunk_err = max(chunk_err, float((got - ref).abs().max()))
    assert chunk_err < 1e-4, f"chunked prefill differs from full forward by {chunk_err}"

    orig_err = check_original_names(model, cfg, seqs[0], logits[0])
    assert orig_err == 0.0, f"original-name round trip differs by {orig_err}"

    # ---- write ---------------------------------------------------------------------------
    out_dir.mkdir(parents=True, exist_ok=True)
    gguf_path = out_dir / f"{name}.gguf"
    tensors = write_gguf(gguf_path, model, cfg, name)
    seq_entries = []
    for k, (s, l) in enumerate(zip(seqs, logits)):
        p = out_dir / f"{name}.seq{k}.logits.npy"
        np.save(p, l.numpy().astype(np.float32))
        seq_entries.append({
            "tokens": s,
            "logits_file": p.name,
            "logits_shape": list(l.shape),
            "logits_dtype": "float32",
            "sha256": sha256(p),
        })

    cov = {
        "layer_types": cfg.layer_types,
        "mlp_layer_types": cfg.mlp_layer_types,
        "compress_ratios": compress_ratios(cfg),
        "compressed_rows_longest_seq": {f"{i}:{k}": v for (i, k), v in sorted(probe.rows.items())},
        "indexer_strict_subset_queries": {str(k): v for k, v in sorted(probe.strict_subset_queries.items())},
        "router_bias_changed_tokens": {str(k): v for k, v in sorted(probe.bias_changed.items())},
        "swiglu_clamped_values_routed": {str(k): v for k, v in sorted(probe.clamp_routed.items())},
        "swiglu_clamped_values_shared": {str(k): v for k, v in sorted(probe.clamp_shared.items())},
        "min_index_topk_margin_relative": im,
        "min_router_topk_margin": rm,
        "chunked_vs_full_max_abs_diff": chunk_err,
        "chunk_plan": chunk_plan,
    }
    hf_cfg = json.loads(cfg.to_json_string(use_diff=False))
    for k in list(hf_cfg):
        if k.startswith("_") or k in ("transformers_version",):
            hf_cfg.pop(k)
    return {
        "name": name,
        "gguf": gguf_path.name,
        "gguf_sha256": sha256(gguf_path),
        "gguf_bytes": gguf_path.stat().st_size,
        "weight_seed": seed,
        "token_seed": spec["seed"] + 1,
        "transformers_config": hf_cfg,
        "gguf_metadata": {k: v for k, v, _ in gguf_metadata(cfg, name)},
        "tensors": tensors,
        "sequences": seq_entries,
        "coverage": cov,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", help="build just the named fixture")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    from importlib.metadata import version

    versions = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gguf": version("gguf"),
        "numpy": np.__version__,
        "safetensors": version("safetensors"),
    }
    if versions["transformers"] != "5.25.0" or versions["gguf"] != "0.19.0":
        print(f"warning: pinned transformers 5.25.0 / gguf 0.19.0, found {versions}", file=sys.stderr)

    manifest_path = args.out / "manifest.json"
    entries = []
    for spec in FIXTURES:
        if args.only and spec["name"] != args.only:
            continue
        e = build_fixture(spec, args.out)
        entries.append(e)
        print(f"{e['name']}: gguf {e['gguf_bytes']} B, coverage {json.dumps(e['coverage'], sort_keys=True)}")
    manifest = {
        "about": "DeepSeek V4 reference fixtures for lockstep; made by tools/v4_fixtures/make_fixtures.py",
        "llama_cpp": {"repo": "ggml-org/llama.cpp", "commit": LLAMA_CPP_COMMIT, "file": LLAMA_CPP_FILE},
        "versions": versions,
        "vocab": {"size": VOCAB, "bos": BOS_ID, "eos": EOS_ID, "model": "gpt2 byte-level, no merges"},
        "fixtures": entries,
    }
    # make_dspark.py's entry (the DSpark support files) survives a rebuild of the targets;
    # rerun make_dspark.py after it, since the support shapes follow the targets.
    if manifest_path.exists():
        old = json.loads(manifest_path.read_text())
        if "dspark" in old:
            manifest["dspark"] = old["dspark"]
    args.out.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(p.stat().st_size for p in args.out.iterdir() if p.is_file())
    print(f"wrote {manifest_path}; fixture dir total {total} bytes ({total / 2**20:.2f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
