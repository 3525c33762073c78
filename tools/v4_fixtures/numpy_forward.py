#!/usr/bin/env python3
"""An independent numpy (float64) DeepSeek V4 forward written from FORWARD.md, reading only the
GGUF (tensor names and metadata keys of llama.cpp's deepseek4 layout), checked against the
stored transformers logits. It exists to prove FORWARD.md and the GGUF together are complete
enough to port; it is not fast.

Run:  python numpy_forward.py [DIR] [--decisions]   (default: crates/model/tests/fixtures/deepseek4)

With --decisions it also writes DIR/decisions.json: every top-k decision of every sequence (the
indexer's kept rows per CSA layer and query, where more rows are visible than it keeps; the
learned router's experts per layer and token), which the Rust tests compare with their own.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "crates" / "model" / "tests" / "fixtures" / "deepseek4"


class G:
    def __init__(self, path: Path):
        r = GGUFReader(path)
        self.t = {t.name: np.array(t.data).astype(np.float64 if t.data.dtype != np.int32 else np.int64) for t in r.tensors}
        self.kv = {}
        for k, f in r.fields.items():
            if f.types and f.types[0] == GGUFValueType.ARRAY:
                if k.startswith("tokenizer."):
                    continue
                self.kv[k] = [x.item() if hasattr(x, "item") else x for x in f.contents()]
            else:
                self.kv[k] = f.contents()

    def m(self, key):
        return self.kv["deepseek4." + key]


def rms(x, eps, w=None):
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if w is None else y * w


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x, axis=-1):
    x = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def inv_freq(g: G, compressed: bool) -> np.ndarray:
    rd = g.m("rope.dimension_count")
    theta = g.m("attention.compress_rope_freq_base") if compressed else g.m("rope.freq_base")
    base = 1.0 / theta ** (np.arange(0, rd, 2) / rd)
    if not compressed or g.kv.get("deepseek4.rope.scaling.type") != "yarn":
        return base
    f, L0 = g.m("rope.scaling.factor"), g.m("rope.scaling.original_context_length")
    bf, bs = g.m("rope.scaling.yarn_beta_fast"), g.m("rope.scaling.yarn_beta_slow")

    def corr(r):
        return rd * math.log(L0 / (r * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr(bf)), 0), min(math.ceil(corr(bs)), rd - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rd // 2) - low) / (high - low), 0, 1)
    extra = 1 - ramp
    return base / f * (1 - extra) + base * extra


def rope(x, pos, freqs, sign=1.0):
    """Interleaved rope on the trailing 2*len(freqs) channels; x [..., S?, d] with pos broadcast
    over x's second-to-last axis."""
    rd = 2 * len(freqs)
    ang = np.asarray(pos, dtype=np.float64)[:, None] * freqs[None, :]
    c, s = np.cos(ang), sign * np.sin(ang)
    y = x.copy()
    a, b = x[..., -rd::2], x[..., -rd + 1 :: 2]
    y[..., -rd::2] = a * c - b * s
    y[..., -rd + 1 :: 2] = b * c + a * s
    return y


def hc(h, fn, base, scale, N, eps, eps_hc, iters):
    S = h.shape[0]
    x = rms(h.reshape(S, -1), eps)
    mix = x @ fn.T
    pre = sigmoid(mix[:, :N] * scale[0] + base[:N]) + eps_hc
    post = 2 * sigmoid(mix[:, N : 2 * N] * scale[1] + base[N : 2 * N])
    C = softmax(mix[:, 2 * N :].reshape(S, N, N) * scale[2] + base[2 * N :].reshape(N, N), -1) + eps_hc
    C = C / (C.sum(1, keepdims=True) + eps_hc)
    for _ in range(iters - 1):
        C = C / (C.sum(2, keepdims=True) + eps_hc)
        C = C / (C.sum(1, keepdims=True) + eps_hc)
    collapsed = (pre[:, :, None] * h).sum(1)
    return post, C, collapsed


def compress(x, wkv, wgate, ape, norm, m, width, overlap, eps, freqs):
    """All complete windows of one sequence starting at position 0 -> rows [n_w, width]."""
    S = x.shape[0]
    nw = S // m
    if nw == 0:
        return np.zeros((0, width))
    c = (x[: nw * m] @ wkv.T).reshape(nw, m, -1)
    z = (x[: nw * m] @ wgate.T).reshape(nw, m, -1) + ape[None]
    if overlap:
        kv = np.zeros((nw, 2 * m, width))
        gt = np.full((nw, 2 * m, width), -np.inf)
        kv[:, m:], gt[:, m:] = c[..., width:], z[..., width:]
        kv[1:, :m], gt[1:, :m] = c[:-1, :, :width], z[:-1, :, :width]
    else:
        kv, gt = c, z
    r = (softmax(gt, axis=1) * kv).sum(1)
    r = rms(r, eps, norm)
    return rope(r, np.arange(nw) * m, freqs)


def forward(g: G, tokens: list[int], decisions: dict | None = None, capture: dict | None = None) -> np.ndarray:
    """Logits [S, vocab]. With `capture = {"layers": [...]}` it also stores, for each listed
    layer, the layer's input averaged over the HC streams in capture["rows"][layer] ([S, D]):
    what a DSpark drafter reads (make_dspark.py's reference)."""
    t = g.t
    S = len(tokens)
    H, hd = g.m("attention.head_count"), g.m("attention.key_length")
    N, iters, eps_hc = g.m("hyper_connection.count"), g.m("hyper_connection.sinkhorn_iterations"), g.m("hyper_connection.epsilon")
    eps, W = g.m("attention.layer_norm_rms_epsilon"), g.m("attention.sliding_window")
    G_, R = g.m("attention.output_group_count"), g.m("attention.output_lora_rank")
    nI, dI, kI = g.m("attention.indexer.head_count"), g.m("attention.indexer.key_length"), g.m("attention.indexer.top_k")
    ratios, L = g.m("attention.compress_ratios"), g.m("block_count")
    k = g.m("expert_used_count")
    n_hash, scale_r, limit = g.m("hash_layer_count"), g.m("expert_weights_scale"), g.m("swiglu_clamp_exp")
    pos = np.arange(S)
    f_main, f_comp = inv_freq(g, False), inv_freq(g, True)

    h = np.repeat(t["token_embd.weight"][tokens][:, None, :], N, axis=1)
    for i in range(L):
        if capture is not None and i in capture["layers"]:
            capture.setdefault("rows", {})[i] = h.mean(1)
        b = f"blk.{i}."
        m = ratios[i]
        fr = f_comp if m else f_main
        # ---- attention
        post, C, col = hc(h, t[b + "hc_attn_fn.weight"], t[b + "hc_attn_base.weight"], t[b + "hc_attn_scale.weight"], N, eps, eps_hc, iters)
        x = rms(col, eps, t[b + "attn_norm.weight"])
        qr = rms(x @ t[b + "attn_q_a.weight"].T, eps, t[b + "attn_q_a_norm.weight"])
        q = rms((qr @ t[b + "attn_q_b.weight"].T).reshape(S, H, hd), eps)
        q = rope(q.transpose(1, 0, 2), pos, fr).transpose(1, 0, 2)  # [S, H, hd]
        kv = rope(rms(x @ t[b + "attn_kv.weight"].T, eps, t[b + "attn_kv_a_norm.weight"]), pos, fr)  # [S, hd]
        keys = kv
        mask = np.where((pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - W), 0.0, -np.inf)
        if m:
            csa = m == 4
            rows = compress(x, t[b + "attn_compressor_kv.weight"], t[b + "attn_compressor_gate.weight"],
                            t[b + "attn_compressor_ape.weight"], t[b + "attn_compressor_norm.weight"], m, hd, csa, eps, fr)
            T = rows.shape[0]
            vis = np.arange(T)[None, :] < ((pos + 1) // m)[:, None]  # [S, T]
            if csa and T:
                K = compress(x, t[b + "indexer_compressor_kv.weight"], t[b + "indexer_compressor_gate.weight"],
                             t[b + "indexer_compressor_ape.weight"], t[b + "indexer_compressor_norm.weight"], m, dI, True, eps, fr)
                qI = rope((qr @ t[b + "indexer.attn_q_b.weight"].T).reshape(S, nI, dI).transpose(1, 0, 2), pos, fr).transpose(1, 0, 2)
                wts = (x @ t[b + "indexer.proj.weight"].T) * nI**-0.5  # [S, nI]
                sc = (np.maximum(np.einsum("shd,td->sht", qI, K), 0) * dI**-0.5 * wts[:, :, None]).sum(1)
                sc = np.where(vis, sc, -np.inf)
                keep = np.zeros_like(vis)
                for s in range(S):
                    order = np.argsort(-sc[s], kind="stable")[: min(kI, T)]
                    keep[s, order] = True
                if decisions is not None:
                    d = decisions.setdefault("indexer", {}).setdefault(str(i), {"pos": [], "rows": []})
                    for s in range(S):
                        if vis[s].sum() > kI:
                            d["pos"].append(s)
                            d["rows"].append(sorted(int(x) for x in np.nonzero(vis[s] & keep[s])[0]))
                vis = vis & keep
            keys = np.concatenate([kv, rows], 0)
            mask = np.concatenate([mask, np.where(vis, 0.0, -np.inf)], 1)
        logit = np.einsum("shd,jd->hsj", q, keys) * hd**-0.5 + mask[None]
        sink = np.broadcast_to(t[b + "attn_sinks.weight"][:, None, None], (H, S, 1))
        p = softmax(np.concatenate([logit, sink], -1), -1)[..., :-1]
        o = np.einsum("hsj,jd->shd", p, keys)
        o = rope(o.transpose(1, 0, 2), pos, fr, sign=-1.0).transpose(1, 0, 2).reshape(S, G_, -1)
        wa = t[b + "attn_output_a.weight"].reshape(G_, R, -1)
        z = np.einsum("sgi,gri->sgr", o, wa).reshape(S, G_ * R)
        a = z @ t[b + "attn_output_b.weight"].T
        h = post[:, :, None] * a[:, None, :] + np.einsum("sjk,sjd->skd", C, h)
        # ---- MoE
        post, C, col = hc(h, t[b + "hc_ffn_fn.weight"], t[b + "hc_ffn_base.weight"], t[b + "hc_ffn_scale.weight"], N, eps, eps_hc, iters)
        x = rms(col, eps, t[b + "ffn_norm.weight"])
        l = x @ t[b + "ffn_gate_inp.weight"].T
        sc = np.sqrt(np.log1p(np.exp(l)))
        if i < n_hash:
            idx = t[b + "ffn_gate_tid2eid.weight"][tokens]
        else:
            idx = np.argsort(-(sc + t[b + "exp_probs_b.bias"]), axis=1, kind="stable")[:, :k]
            if decisions is not None:
                decisions.setdefault("router", {})[str(i)] = [sorted(int(x) for x in r) for r in idx]
        gw = np.take_along_axis(sc, idx, 1)
        gw = gw / (gw.sum(1, keepdims=True) + 1e-20) * scale_r
        Lm = limit[i]

        def swiglu(xx, w1, w3, w2):
            gt = np.minimum(xx @ w1.T, Lm)
            up = np.clip(xx @ w3.T, -Lm, Lm)
            return (gt * sigmoid(gt) * up) @ w2.T

        out = swiglu(x, t[b + "ffn_gate_shexp.weight"], t[b + "ffn_up_shexp.weight"], t[b + "ffn_down_shexp.weight"])
        for s in range(S):
            for j in range(k):
                e = idx[s, j]
                out[s] += gw[s, j] * swiglu(x[s], t[b + "ffn_gate_exps.weight"][e], t[b + "ffn_up_exps.weight"][e], t[b + "ffn_down_exps.weight"][e])
        h = post[:, :, None] * out[:, None, :] + np.einsum("sjk,sjd->skd", C, h)
    x = rms(h.reshape(S, -1), eps)
    pre = sigmoid((x @ t["output_hc_fn.weight"].T) * t["output_hc_scale.weight"][0] + t["output_hc_base.weight"]) + eps_hc
    y = rms((pre[:, :, None] * h).sum(1), eps, t["output_norm.weight"])
    return y @ t["output.weight"].T


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    dump = "--decisions" in sys.argv[1:]
    root = Path(args[0]) if args else DEFAULT_DIR
    manifest = json.loads((root / "manifest.json").read_text())
    worst_all = 0.0
    all_decisions: dict = {}
    for fx in manifest["fixtures"]:
        g = G(root / fx["gguf"])
        for s in fx["sequences"]:
            want = np.load(root / s["logits_file"]).astype(np.float64)
            dec = all_decisions.setdefault(fx["name"], {}).setdefault(s["logits_file"], {}) if dump else None
            got = forward(g, s["tokens"], dec)
            d = float(np.abs(got - want).max())
            worst_all = max(worst_all, d)
            print(f"{fx['name']} {s['logits_file']}: {len(s['tokens'])} tokens, max |numpy f64 - transformers f32| = {d:.2e}")
    assert worst_all < 1e-4, worst_all
    print("numpy forward matches")
    if dump:
        out = {
            "about": "top-k decisions of numpy_forward.py (float64) on every fixture sequence: "
            "indexer[layer] = kept compressed rows (sorted) for each query position with more "
            "visible rows than index_topk; router[layer] = the learned layers' experts (sorted) per token",
            "fixtures": all_decisions,
        }
        (root / "decisions.json").write_text(json.dumps(out, separators=(",", ":")) + "\n")
        print(f"wrote {root / 'decisions.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
