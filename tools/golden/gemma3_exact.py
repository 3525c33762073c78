"""Exact reference log-probs for gemma3-270m: an f64 forward over the dequantized GGUF
weights (llama.cpp's gguf-py), exact GELU-tanh, no KV rounding, no activation
quantization. Teacher-forced on each golden case's prompt_tokens + completion_tokens[:-1];
writes, per step, the exact log-probs of the reference's top-5 ids, the exact argmax and
its top-2 gap. Used by crates/model/tests/model/golden_gemma3.rs as a second oracle for the short
prompts recorded without the BOS the model expects (gemma3-270m-nobos.json), where
llama.cpp itself strays from the exact model by several nats.

Run by `python3 tools/golden/make.py exact`; by hand:
PYTHONPATH=<llama.cpp>/gguf-py python3 gemma3_exact.py MODEL.gguf GOLDEN.json OUT.json
(numpy; about 2 GB of memory; minutes on two cores)
"""
import sys, json, numpy as np
import gguf
from gguf.quants import dequantize
MODEL, GOLDEN, OUT = sys.argv[1:4]
r = gguf.GGUFReader(MODEL)
T = {t.name: t for t in r.tensors}
def W(name, dtype=np.float64):
    t = T[name]
    d = dequantize(t.data, t.tensor_type)
    return np.asarray(d, dtype=dtype).reshape([int(x) for x in reversed(t.shape)])
E, H, HKV, HD, L, WIN, eps = 640, 4, 1, 256, 18, 512, 1e-6
emb = W('token_embd.weight', np.float32)  # [vocab, 640]
def rms(x, w): return x / np.sqrt((x*x).mean(-1, keepdims=True) + eps) * w
def rope(x, pos, base):  # x [n, heads, hd], neox
    half = HD // 2
    freq = base ** (-(2*np.arange(half))/HD)
    th = pos[:, None] * freq[None, :]
    c, s = np.cos(th)[:, None, :], np.sin(th)[:, None, :]
    x0, x1 = x[..., :half], x[..., half:]
    return np.concatenate([x0*c - x1*s, x0*s + x1*c], -1)
def gelu(g): return 0.5*g*(1+np.tanh(np.sqrt(2/np.pi)*(g+0.044715*g**3)))
layers = []
for i in range(L):
    p = lambda n: W(f'blk.{i}.{n}.weight')
    layers.append({k: p(k) for k in ['attn_norm','attn_q','attn_k','attn_v','attn_output','attn_q_norm','attn_k_norm','post_attention_norm','ffn_norm','ffn_gate','ffn_up','ffn_down','post_ffw_norm']})
onorm = W('output_norm.weight')
emb64 = emb.astype(np.float64)
def forward(toks):
    n = len(toks); pos = np.arange(n, dtype=np.float64)
    x = emb[toks].astype(np.float64) * np.sqrt(640.0)
    for i, ly in enumerate(layers):
        swa = i % 6 < 5
        h = rms(x, ly['attn_norm'])
        q = (h @ ly['attn_q'].T).reshape(n, H, HD); k = (h @ ly['attn_k'].T).reshape(n, HKV, HD); v = (h @ ly['attn_v'].T).reshape(n, HKV, HD)
        q = rms(q, ly['attn_q_norm']); k = rms(k, ly['attn_k_norm'])
        base = 10000.0 if swa else 1e6
        q = rope(q, pos, base); k = rope(k, pos, base)
        out = np.zeros((n, H, HD))
        for hh in range(H):
            s = (q[:, hh, :] @ k[:, 0, :].T) / 16.0
            mask = np.tril(np.ones((n, n), bool))
            if swa: mask &= (np.arange(n)[:, None] - np.arange(n)[None, :]) < WIN
            s = np.where(mask, s, -np.inf); s -= s.max(-1, keepdims=True); e = np.exp(s); e /= e.sum(-1, keepdims=True)
            out[:, hh, :] = e @ v[:, 0, :]
        a = out.reshape(n, H*HD) @ ly['attn_output'].T
        x = x + rms(a, ly['post_attention_norm'])
        h = rms(x, ly['ffn_norm'])
        f = (gelu(h @ ly['ffn_gate'].T) * (h @ ly['ffn_up'].T)) @ ly['ffn_down'].T
        x = x + rms(f, ly['post_ffw_norm'])
    hN = rms(x, onorm)
    logits = hN @ emb64.T
    m = logits.max(-1, keepdims=True); return logits - (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))

g = json.load(open(GOLDEN))
res = {}
for c in g['cases']:
    p = len(c['prompt_tokens'])
    toks = c['prompt_tokens'] + c['completion_tokens'][:-1]
    ls = forward(toks)
    steps = []
    for j, st in enumerate(c['steps']):
        row = ls[p - 1 + j]
        order = np.argsort(-row, kind='stable')[:2]
        steps.append({'top': [[i, float(row[i])] for i, _ in st['top']], 'argmax': int(order[0]), 'gap': float(row[order[0]] - row[order[1]])})
    res[c['name']] = steps
    print(c['name'], flush=True)
out = {"model": "gemma3-270m", "golden": GOLDEN.split("/")[-1], "cases": {}}
for k, v in res.items():
    out["cases"][k] = [{"top": [[int(i), round(lp, 5)] for i, lp in s["top"]], "argmax": s["argmax"], "gap": round(s["gap"], 5)} for s in v]
json.dump(out, open(OUT, "w"), separators=(",", ":"))
