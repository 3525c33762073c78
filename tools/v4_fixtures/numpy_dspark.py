#!/usr/bin/env python3
"""A float64 numpy forward of the DSpark block drafter, written from the reference semantics
(DeepSeek's DSparkBlock / DSparkAttention / forward_head, as quoted in antirez/ds4's port
notes), reading only the GGUFs: the target fixture (through numpy_forward.py, which also
captures the target layers' inputs averaged over the HC streams) and its support file. It
writes the reference the Rust port is checked against:

  <support>.ref.npy   float32 [anchors, block, 2*vocab + D + 1]: per anchor and slot the
                      base logits, the Markov-corrected logits (teacher-forced: the previous
                      token of slot k is the sequence's token at anchor + k), the slot's
                      hidden row after the HyperHead collapse, and the confidence

and the `reference` part of the manifest's dspark entry (sequence, anchors, layout, sha256,
the smallest router margin: every stage's top-k choice clears 5e-5, so an f32 port picks
the same experts).

Run:  python numpy_dspark.py [DIR]   (needs numpy and the gguf package, like numpy_forward.py)
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

import numpy_forward as nf

DEFAULT_DIR = nf.DEFAULT_DIR
# The context is a prefix of the target fixture's first sequence (whose target-side top-k
# decisions clear their margins); anchors below, at and past the sliding window.
SEQUENCE = 0
ANCHORS = [20, 77, 250]
MARGIN = 5e-5


def load_support(path: Path) -> tuple[dict, dict]:
    r = GGUFReader(path)
    t = {}
    for x in r.tensors:
        a = dequantize(x.data, x.tensor_type).astype(np.float64)
        t[x.name] = a.reshape([int(d) for d in reversed(x.shape)])
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.")}
    return t, kv


def stage_forward(g, t, p, h, pos, ctx_kv, margins):
    """One stage over the block streams h [B, N, D] at positions pos; ctx_kv [nw, hd]."""
    B = h.shape[0]
    H, hd = g.m("attention.head_count"), g.m("attention.key_length")
    N, iters, eps_hc = g.m("hyper_connection.count"), g.m("hyper_connection.sinkhorn_iterations"), g.m("hyper_connection.epsilon")
    eps = g.m("attention.layer_norm_rms_epsilon")
    G_, R = g.m("attention.output_group_count"), g.m("attention.output_lora_rank")
    k = g.m("expert_used_count")
    scale_r = g.m("expert_weights_scale")
    limit = g.m("swiglu_clamp_exp")[-1]
    fr = nf.inv_freq(g, False)
    post, C, col = nf.hc(h, t[p + "hc_attn_fn.weight"], t[p + "hc_attn_base.weight"], t[p + "hc_attn_scale.weight"], N, eps, eps_hc, iters)
    x = nf.rms(col, eps, t[p + "attn_norm.weight"])
    qr = nf.rms(x @ t[p + "attn_q_a.weight"].T, eps, t[p + "attn_q_a_norm.weight"])
    q = nf.rms((qr @ t[p + "attn_q_b.weight"].T).reshape(B, H, hd), eps)
    q = nf.rope(q.transpose(1, 0, 2), pos, fr).transpose(1, 0, 2)
    kv = nf.rope(nf.rms(x @ t[p + "attn_kv.weight"].T, eps, t[p + "attn_kv_a_norm.weight"]), pos, fr)
    keys = np.concatenate([ctx_kv, kv], 0)  # every block row sees the window and the block
    logit = np.einsum("shd,jd->hsj", q, keys) * hd**-0.5
    sink = np.broadcast_to(t[p + "attn_sinks.weight"][:, None, None], (H, B, 1))
    pr = nf.softmax(np.concatenate([logit, sink], -1), -1)[..., :-1]
    o = np.einsum("hsj,jd->shd", pr, keys)
    o = nf.rope(o.transpose(1, 0, 2), pos, fr, sign=-1.0).transpose(1, 0, 2).reshape(B, G_, -1)
    wa = t[p + "attn_output_a.weight"].reshape(G_, R, -1)
    z = np.einsum("sgi,gri->sgr", o, wa).reshape(B, G_ * R)
    a = z @ t[p + "attn_output_b.weight"].T
    h = post[:, :, None] * a[:, None, :] + np.einsum("sjk,sjd->skd", C, h)
    post, C, col = nf.hc(h, t[p + "hc_ffn_fn.weight"], t[p + "hc_ffn_base.weight"], t[p + "hc_ffn_scale.weight"], N, eps, eps_hc, iters)
    x = nf.rms(col, eps, t[p + "ffn_norm.weight"])
    sc = np.sqrt(np.log1p(np.exp(x @ t[p + "ffn_gate_inp.weight"].T)))
    biased = sc + t[p + "exp_probs_b.bias"]
    idx = np.argsort(-biased, axis=1, kind="stable")[:, :k]
    srt = -np.sort(-biased, axis=1)
    margins.append(float((srt[:, k - 1] - srt[:, k]).min()))
    gw = np.take_along_axis(sc, idx, 1)
    gw = gw / (gw.sum(1, keepdims=True) + 1e-20) * scale_r

    def swiglu(xx, w1, w3, w2):
        gt = np.minimum(xx @ w1.T, limit)
        up = np.clip(xx @ w3.T, -limit, limit)
        return (gt * nf.sigmoid(gt) * up) @ w2.T

    out = swiglu(x, t[p + "ffn_gate_shexp.weight"], t[p + "ffn_up_shexp.weight"], t[p + "ffn_down_shexp.weight"])
    for s in range(B):
        for j in range(k):
            e = idx[s, j]
            out[s] += gw[s, j] * swiglu(x[s], t[p + "ffn_gate_exps.weight"][e], t[p + "ffn_up_exps.weight"][e], t[p + "ffn_down_exps.weight"][e])
    return post[:, :, None] * out[:, None, :] + np.einsum("sjk,sjd->skd", C, h)


def main() -> int:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR
    manifest = json.loads((root / "manifest.json").read_text())
    for entry in manifest["dspark"]["supports"]:
        fx = next(f for f in manifest["fixtures"] if f["name"] == entry["target"])
        g = nf.G(root / fx["gguf"])
        t, kv = load_support(root / entry["gguf"])
        dsp = lambda k: kv["deepseek4.dspark." + k]  # noqa: E731
        n_stages, B, noise = dsp("n_mtp_layers"), dsp("block_size"), dsp("noise_token_id")
        layers = sorted(dsp(f"target_layer_ids.{i}") for i in range(3))
        N, eps, eps_hc = g.m("hyper_connection.count"), g.m("attention.layer_norm_rms_epsilon"), g.m("hyper_connection.epsilon")
        W = g.m("attention.sliding_window")
        fr = nf.inv_freq(g, False)
        tokens = fx["sequences"][SEQUENCE]["tokens"]
        cap = {"layers": layers}
        nf.forward(g, tokens, capture=cap)
        main_x = nf.rms(np.concatenate([cap["rows"][i] for i in layers], -1) @ t["mtp.0.main_proj.weight"].T, eps, t["mtp.0.main_norm.weight"])
        last = f"mtp.{n_stages - 1}."
        w1, w2 = t[last + "markov_head.markov_w1.weight"], t[last + "markov_head.markov_w2.weight"]
        proj = t[last + "confidence_head.proj.weight"].reshape(-1)
        out, margins = [], []
        for a in ANCHORS:
            lo = max(0, a - W)
            ids = [tokens[a]] + [noise] * (B - 1)
            pos = np.arange(a, a + B)
            h = np.repeat(g.t["token_embd.weight"][ids][:, None, :], N, axis=1)
            for s in range(n_stages):
                p = f"mtp.{s}."
                ctx_kv = nf.rope(nf.rms(main_x[lo:a] @ t[p + "attn_kv.weight"].T, eps, t[p + "attn_kv_a_norm.weight"]), np.arange(lo, a), fr)
                h = stage_forward(g, t, p, h, pos, ctx_kv, margins)
            x = nf.rms(h.reshape(B, -1), eps)
            pre = nf.sigmoid((x @ t[last + "hc_head_fn.weight"].T) * t[last + "hc_head_scale.weight"][0] + t[last + "hc_head_base.weight"]) + eps_hc
            hidden = (pre[:, :, None] * h).sum(1)
            base = nf.rms(hidden, eps, t[last + "norm.weight"]) @ g.t["output.weight"].T
            rows = []
            for k in range(B):
                e = w1[tokens[a + k]]
                logits = base[k] + w2 @ e
                conf = nf.sigmoid(proj @ np.concatenate([hidden[k], e]))
                rows.append(np.concatenate([base[k], logits, hidden[k], [conf]]))
            out.append(rows)
        margin = min(margins)
        assert margin > MARGIN, f"a stage router choice is within {margin:.2e} of a tie: pick other anchors"
        ref = np.asarray(out, dtype="<f4")
        name = entry["gguf"].replace(".gguf", ".ref.npy")
        np.save(root / name, ref)
        blob = (root / name).read_bytes()
        entry["reference"] = {
            "file": name,
            "sha256": hashlib.sha256(blob).hexdigest(),
            "sequence": SEQUENCE,
            "anchors": ANCHORS,
            "shape": list(ref.shape),
            "layout": "per anchor and slot: base logits [vocab], Markov-corrected logits "
            "(previous token = the sequence's token at anchor + slot) [vocab], hidden after "
            "the HyperHead collapse [D], confidence [1]",
            "min_router_topk_margin": margin,
        }
        print(f"{name}: shape {ref.shape}, min router margin {margin:.2e}")
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
