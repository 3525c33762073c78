#!/usr/bin/env python3
"""Self-check of the DeepSeek V4 fixtures written by make_fixtures.py.

For every fixture in manifest.json:
  1. every file's sha256 matches the manifest;
  2. the GGUF, re-read with the `gguf` package's GGUFReader, has architecture "deepseek4", the
     metadata the manifest lists (key, type, value), and exactly the tensors the layer plan
     implies -- names, shapes (GGUF ne order) and types spelled out here independently of
     make_fixtures.py's mapping tables;
  3. a transformers model rebuilt from the GGUF's tensors alone reproduces the stored logits.

Run:  python check_fixtures.py [DIR]   (default: crates/model/tests/fixtures/deepseek4)
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "crates" / "model" / "tests" / "fixtures" / "deepseek4"
F16, F32, I32 = Q.F16, Q.F32, Q.I32


def expected_tensors(c: dict, ratios: list[int]) -> dict[str, tuple[tuple[int, ...], Q]]:
    """name -> (ne, type) for the llama.cpp deepseek4 layout. ne is GGUF order (fastest first)."""
    D, V, H, hd = c["hidden_size"], c["vocab_size"], c["num_attention_heads"], c["head_dim"]
    hc, qr, og, olr = c["hc_mult"], c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    E, k, I = c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
    ih, ihd = c["index_n_heads"], c["index_head_dim"]
    mix = (2 + hc) * hc
    t = {
        "token_embd.weight": ((D, V), F16),
        "output.weight": ((D, V), F16),
        "output_norm.weight": ((D,), F32),
        "output_hc_fn.weight": ((hc * D, hc), F16),
        "output_hc_base.weight": ((hc,), F32),
        "output_hc_scale.weight": ((1,), F32),
    }
    for i, r in enumerate(ratios):
        b = f"blk.{i}."
        t.update({
            b + "attn_norm.weight": ((D,), F32),
            b + "ffn_norm.weight": ((D,), F32),
            b + "hc_attn_fn.weight": ((hc * D, mix), F16),
            b + "hc_attn_base.weight": ((mix,), F32),
            b + "hc_attn_scale.weight": ((3,), F32),
            b + "hc_ffn_fn.weight": ((hc * D, mix), F16),
            b + "hc_ffn_base.weight": ((mix,), F32),
            b + "hc_ffn_scale.weight": ((3,), F32),
            b + "attn_sinks.weight": ((H,), F32),
            b + "attn_q_a.weight": ((D, qr), F16),
            b + "attn_q_a_norm.weight": ((qr,), F32),
            b + "attn_q_b.weight": ((qr, H * hd), F16),
            b + "attn_kv.weight": ((D, hd), F16),
            b + "attn_kv_a_norm.weight": ((hd,), F32),
            b + "attn_output_a.weight": ((H * hd // og, og * olr), F16),
            b + "attn_output_b.weight": ((og * olr, D), F16),
            b + "ffn_gate_inp.weight": ((D, E), F32),
            b + "ffn_gate_exps.weight": ((D, I, E), F16),
            b + "ffn_up_exps.weight": ((D, I, E), F16),
            b + "ffn_down_exps.weight": ((I, D, E), F16),
            b + "ffn_gate_shexp.weight": ((D, I), F16),
            b + "ffn_up_shexp.weight": ((D, I), F16),
            b + "ffn_down_shexp.weight": ((I, D), F16),
        })
        if c["mlp_layer_types"][i] == "hash_moe":
            t[b + "ffn_gate_tid2eid.weight"] = ((k, V), I32)
        else:
            t[b + "exp_probs_b.bias"] = ((E,), F32)
        if r:
            w = 2 * hd if r == 4 else hd  # CSA keeps two overlapping series
            t.update({
                b + "attn_compressor_kv.weight": ((D, w), F16),
                b + "attn_compressor_gate.weight": ((D, w), F16),
                b + "attn_compressor_ape.weight": ((w, r), F16),
                b + "attn_compressor_norm.weight": ((hd,), F32),
            })
        if r == 4:
            t.update({
                b + "indexer.attn_q_b.weight": ((qr, ih * ihd), F16),
                b + "indexer.proj.weight": ((D, ih), F16),
                b + "indexer_compressor_kv.weight": ((D, 2 * ihd), F16),
                b + "indexer_compressor_gate.weight": ((D, 2 * ihd), F16),
                b + "indexer_compressor_ape.weight": ((2 * ihd, r), F16),
                b + "indexer_compressor_norm.weight": ((ihd,), F32),
            })
    return t


def field_value(f):
    vt = f.types[0]
    if vt == GGUFValueType.ARRAY:
        return [x.item() if hasattr(x, "item") else x for x in f.contents()]
    return f.contents()


def check_metadata(r: GGUFReader, md: dict) -> None:
    arch = r.fields["general.architecture"].contents()
    assert arch == "deepseek4", arch
    for key, want in md.items():
        assert key in r.fields, f"missing metadata key {key}"
        got = field_value(r.fields[key])
        if isinstance(want, float):
            assert abs(got - want) <= 1e-6 * max(1.0, abs(want)), (key, got, want)
        elif isinstance(want, list) and want and isinstance(want[0], float):
            assert np.allclose(got, want), (key, got, want)
        else:
            assert got == want, (key, got, want)
    assert r.fields["tokenizer.ggml.model"].contents() == "gpt2"
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].contents())
    assert n_vocab == md["deepseek4.vocab_size"], n_vocab


def gguf_to_hf_state(r: GGUFReader, c: dict) -> dict[str, torch.Tensor]:
    """Inverse of the llama.cpp naming, written out independently of make_fixtures.py."""
    top = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output.weight": "lm_head.weight",
        "output_norm.weight": "model.norm.weight",
        "output_hc_fn.weight": "model.hc_head.hc_fn",
        "output_hc_base.weight": "model.hc_head.hc_base",
        "output_hc_scale.weight": "model.hc_head.hc_scale",
    }
    layer = {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "hc_attn_fn.weight": "attn_hc.fn",
        "hc_attn_base.weight": "attn_hc.base",
        "hc_attn_scale.weight": "attn_hc.scale",
        "hc_ffn_fn.weight": "ffn_hc.fn",
        "hc_ffn_base.weight": "ffn_hc.base",
        "hc_ffn_scale.weight": "ffn_hc.scale",
        "attn_sinks.weight": "self_attn.sinks",
        "attn_q_a.weight": "self_attn.q_a_proj.weight",
        "attn_q_a_norm.weight": "self_attn.q_a_norm.weight",
        "attn_q_b.weight": "self_attn.q_b_proj.weight",
        "attn_kv.weight": "self_attn.kv_proj.weight",
        "attn_kv_a_norm.weight": "self_attn.kv_norm.weight",
        "attn_output_a.weight": "self_attn.o_a_proj.weight",
        "attn_output_b.weight": "self_attn.o_b_proj.weight",
        "attn_compressor_kv.weight": "self_attn.compressor.kv_proj.weight",
        "attn_compressor_gate.weight": "self_attn.compressor.gate_proj.weight",
        "attn_compressor_ape.weight": "self_attn.compressor.position_bias",
        "attn_compressor_norm.weight": "self_attn.compressor.kv_norm.weight",
        "indexer.attn_q_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
        "indexer.proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
        "indexer_compressor_kv.weight": "self_attn.compressor.indexer.kv_proj.weight",
        "indexer_compressor_gate.weight": "self_attn.compressor.indexer.gate_proj.weight",
        "indexer_compressor_ape.weight": "self_attn.compressor.indexer.position_bias",
        "indexer_compressor_norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
        "ffn_gate_inp.weight": "mlp.gate.weight",
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
        "ffn_gate_tid2eid.weight": "mlp.gate.tid2eid",
        "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
        "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
        "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
        "ffn_down_exps.weight": "mlp.experts.down_proj",
    }
    raw = {t.name: np.array(t.data) for t in r.tensors}
    out = {}
    for name, a in raw.items():
        if name in top:
            out[top[name]] = torch.from_numpy(a.astype(np.float32))
            continue
        _, bid, rest = name.split(".", 2)
        pre = f"model.layers.{bid}."
        if rest in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
            continue
        tensor = torch.from_numpy(a.astype(np.int64 if a.dtype == np.int32 else np.float32))
        out[pre + layer[rest]] = tensor
        if rest == "ffn_down_exps.weight":
            g = raw[f"blk.{bid}.ffn_gate_exps.weight"].astype(np.float32)
            u = raw[f"blk.{bid}.ffn_up_exps.weight"].astype(np.float32)
            out[pre + "mlp.experts.gate_up_proj"] = torch.from_numpy(np.concatenate([g, u], axis=1))
    return out


@torch.no_grad()
def check_logits(r: GGUFReader, fx: dict, root: Path) -> float:
    c = dict(fx["transformers_config"])
    cfg = DeepseekV4Config(**{k: v for k, v in c.items() if k not in ("architectures", "model_type", "dtype")})
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    state = gguf_to_hf_state(r, c)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("inv_freq")]
    assert not missing and not unexpected, (missing, unexpected)
    worst = 0.0
    for s in fx["sequences"]:
        want = np.load(root / s["logits_file"])
        got = model(input_ids=torch.tensor([s["tokens"]]), use_cache=False).logits[0].float().numpy()
        assert got.shape == want.shape == tuple(s["logits_shape"]), (got.shape, want.shape)
        worst = max(worst, float(np.abs(got - want).max()))
    return worst


def main() -> int:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR
    manifest = json.loads((root / "manifest.json").read_text())
    for fx in manifest["fixtures"]:
        files = [(fx["gguf"], fx["gguf_sha256"])] + [(s["logits_file"], s["sha256"]) for s in fx["sequences"]]
        for fname, digest in files:
            assert hashlib.sha256((root / fname).read_bytes()).hexdigest() == digest, f"sha256 mismatch: {fname}"
        r = GGUFReader(root / fx["gguf"])
        check_metadata(r, fx["gguf_metadata"])
        c = fx["transformers_config"]
        want = expected_tensors(c, fx["coverage"]["compress_ratios"])
        got = {t.name: (tuple(int(x) for x in t.shape), t.tensor_type) for t in r.tensors}
        assert set(got) == set(want), f"tensor set differs: extra {sorted(set(got) - set(want))}, missing {sorted(set(want) - set(got))}"
        for name, (ne, ty) in want.items():
            assert got[name] == (ne, ty), f"{name}: got {got[name]}, want {(ne, ty)}"
        worst = check_logits(r, fx, root)
        assert worst <= 1e-5, f"{fx['name']}: logits from the GGUF weights differ by {worst}"
        print(f"{fx['name']}: sha256 ok, {len(r.fields)} metadata fields ok, {len(want)} tensors ok, "
              f"GGUF-rebuilt logits max |diff| {worst:.2e}")
    print("all fixtures ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
