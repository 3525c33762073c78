"""f64 emulation of a llama/qwen2 forward with switchable llama.cpp-CPU numerics.

Weights are used exactly (dequantized, f64 matmul); what is emulated is every place where
an implementation rounds something coarser than f32: activation quantization and its
scale storage, the Q8_1 `s` field, attention's f16 conversions, RoPE angle computation.

usage: emul.py MODEL.gguf CASES OUT FLAGS...
  act16     legacy (block-32) activation scale d stored as f16 (llama.cpp Q8_0/Q8_1)
  s16       Q8_1 s = f16(d*sum q) (llama.cpp, Q4_1/Q5_1 weights)
  q8k       Q8_K quantization as llama.cpp (iscale=-127/max signed, d=1/iscale)
  att=f32   attention Q f32, KV f16, exact softmax/accumulation (ours; llama tiled FA)
  att=fa    rows processed in a ubatch of < 64 queries (all decode steps) use llama.cpp's
            one_chunk FA: Q->f16, f16 VKQ accumulator; prompt rows as llama.cpp (tiled f32
            when the prompt has >= 64 tokens)
  att=fa16all  every row through one_chunk FA
  att=nofa  Q->f16, softmax f32, probabilities->f16 (llama.cpp without flash attention)
  rope32    ggml's f32 iterative theta (theta *= theta_scale) instead of exact angles
  noquant   no activation quantization at all (exact forward)
  kv32      KV cache f32 (default f16)
"""
import sys, numpy as np
sys.path.insert(0, '/root/.cache/lockstep/peers/llama.cpp-0.3.36/src/llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py')
import gguf
from gguf import GGMLQuantizationType as QT

f16 = lambda a: np.asarray(a, np.float32).astype(np.float16).astype(np.float64)
f32 = lambda a: np.asarray(a, np.float64).astype(np.float32).astype(np.float64)
LEGACY = {QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0}
KQ = {QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K}

class Weight:
    def __init__(self, t):
        self.type = t.tensor_type
        self.dq = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)  # [N, K]
        self.mins = None
        self.dqT = self.dq.T.astype(np.float64)
        if self.type == QT.Q4_1:
            raw = np.asarray(t.data).reshape(t.data.shape[0], -1, 20)
            self.mins = raw[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float64)

def quant(x, block, flags, q81):
    """x: [T, K] f64 -> (dequantized activations used by the dot, correction per block for Q8_1 s)."""
    T, K = x.shape
    xb = x.astype(np.float32).reshape(T, K // block, block)
    if block == 256 and 'q8k' in flags:
        idx = np.abs(xb).argmax(-1)
        mx = np.take_along_axis(xb, idx[..., None], -1)[..., 0]
        with np.errstate(divide='ignore'):
            iscale = np.where(mx != 0, np.float32(-127.0) / mx, np.float32(0)).astype(np.float32)
        q = np.minimum(127, np.rint((xb * iscale[..., None]).astype(np.float32)))
        d = np.where(iscale != 0, (np.float32(1) / np.where(iscale != 0, iscale, 1)).astype(np.float32), 0)
    else:
        amax = np.abs(xb).max(-1)
        d = (amax / np.float32(127)).astype(np.float32)
        with np.errstate(divide='ignore'):
            idv = np.where(amax != 0, np.float32(127) / np.where(amax != 0, amax, 1), 0).astype(np.float32)
        q = np.clip(np.rint((xb * idv[..., None]).astype(np.float32)), -127, 127)
    d = d.astype(np.float64)
    dd = f16(d) if (block == 32 and 'act16' in flags) else d
    a = (q * dd[..., None]).reshape(T, K)
    corr = None
    if q81:
        qs = q.sum(-1)
        s = f16((d * qs).astype(np.float32)) if 's16' in flags else dd * qs
        corr = s - dd * qs  # [T, nb]
    return a, corr

def matmul(x, w, flags):
    if w.type == QT.F32 or w.type == QT.F16 or 'noquant' in flags:
        return x @ w.dqT
    block = 32 if w.type in LEGACY else 256
    a, corr = quant(x, block, flags, w.mins is not None)
    y = a @ w.dqT
    if corr is not None:
        y += corr @ w.mins.T
    return y

def rmsnorm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

def rope_tables(T, n_dims, base, flags):
    if 'rope32' in flags:
        ts = np.float32(np.power(np.float32(base), np.float32(-2.0) / np.float32(n_dims)))
        th = np.zeros((T, n_dims // 2), np.float32)
        tb = np.arange(T, dtype=np.float32)
        for i in range(n_dims // 2):
            th[:, i] = tb
            tb = (tb * ts).astype(np.float32)
        th = th.astype(np.float64)
        return f32(np.cos(th)), f32(np.sin(th))
    inv = base ** (-np.arange(0, n_dims, 2, dtype=np.float64) / n_dims)
    th = np.arange(T)[:, None] * inv[None, :]
    return np.cos(th), np.sin(th)

def rope(x, cos, sin, neox):  # x [T, H, D]
    D = x.shape[-1]
    if neox:
        a, b = x[..., :D // 2], x[..., D // 2:]
    else:
        a, b = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    ra, rb = a * c - b * s, a * s + b * c
    out = np.empty_like(x)
    if neox:
        out[..., :D // 2], out[..., D // 2:] = ra, rb
    else:
        out[..., 0::2], out[..., 1::2] = ra, rb
    return out

def attention(q, k, v, flags, fa_rows):
    """q [T,H,D], k/v [T,Hkv,D] (already rounded to the KV type). fa_rows: bool [T]."""
    T, H, D = q.shape
    g = H // k.shape[1]
    k = np.repeat(k, g, axis=1); v = np.repeat(v, g, axis=1)
    scale = np.float32(1.0 / np.sqrt(D))
    mask = np.tril(np.ones((T, T), bool))
    att = next((f[4:] for f in flags if f.startswith('att=')), 'f32')
    qq = f16(q) if att in ('nofa',) else q
    s = np.einsum('thd,shd->hts', qq, k) * scale
    s = np.where(mask[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
    if att == 'nofa':
        p = f16(p)
    out = np.einsum('hts,shd->thd', p, v)
    if att in ('fa', 'fa16all') and fa_rows.any():
        rows = np.nonzero(fa_rows)[0]
        q16 = f16(q[rows])                       # [R,H,D]
        sc = f32(np.einsum('rhd,shd->hrs', q16, k) * scale)  # [H,R,T]
        R = len(rows)
        M = np.full((H, R), -np.inf); S = np.zeros((H, R))
        acc = np.zeros((H, R, D), np.float16)
        for j in range(T):
            live = (j <= rows)[None, :]              # [1,R]
            sj = sc[:, :, j]
            up = live & (sj > M)
            ms = np.where(up, np.exp(np.where(up, M - sj, 0)), 1.0)
            vs = np.where(live, np.where(up, 1.0, np.exp(np.minimum(sj - M, 0))), 0.0)
            M = np.where(up, sj, M)
            a32 = acc.astype(np.float32) * ms[..., None].astype(np.float32)
            a32 = np.where(up[..., None], a32.astype(np.float16).astype(np.float32), acc.astype(np.float32))
            vj = v[j].astype(np.float32)            # [H,D]
            new = (a32 + vj[:, None, :] * vs[..., None].astype(np.float32)).astype(np.float16)
            acc = np.where(live[..., None], new, acc)
            S = np.where(live, S * ms + vs, S)
        o = acc.astype(np.float64) / S[..., None]  # [H,R,D]
        out[rows] = o.transpose(1, 0, 2)
    return out

class Model:
    def __init__(self, path):
        r = gguf.GGUFReader(path)
        fv = lambda k: r.fields[k].parts[r.fields[k].data[0]]
        self.arch = bytes(fv('general.architecture')).decode()
        a = self.arch
        self.L = int(fv(f'{a}.block_count')[0]); self.H = int(fv(f'{a}.attention.head_count')[0])
        self.Hkv = int(fv(f'{a}.attention.head_count_kv')[0]); self.E = int(fv(f'{a}.embedding_length')[0])
        self.eps = float(fv(f'{a}.attention.layer_norm_rms_epsilon')[0]); self.base = float(fv(f'{a}.rope.freq_base')[0])
        self.D = self.E // self.H
        self.t = {t.name: t for t in r.tensors}
        self.cache = {}
    def w(self, name):
        if name not in self.cache:
            self.cache[name] = Weight(self.t[name])
        return self.cache[name]
    def vec(self, name):
        return np.asarray(self.t[name].data, np.float64).reshape(-1)
    def forward(self, toks, flags, fa_rows):
        T = len(toks)
        emb = self.w('token_embd.weight')
        x = emb.dq[toks].astype(np.float64)
        cos, sin = rope_tables(T, self.D, self.base, flags)
        neox = self.arch == 'qwen2'
        for l in range(self.L):
            p = f'blk.{l}.'
            h = rmsnorm(x, self.vec(p + 'attn_norm.weight'), self.eps)
            q = matmul(h, self.w(p + 'attn_q.weight'), flags)
            k = matmul(h, self.w(p + 'attn_k.weight'), flags)
            v = matmul(h, self.w(p + 'attn_v.weight'), flags)
            if p + 'attn_q.bias' in self.t:
                q += self.vec(p + 'attn_q.bias'); k += self.vec(p + 'attn_k.bias'); v += self.vec(p + 'attn_v.bias')
            q = rope(q.reshape(T, self.H, self.D), cos, sin, neox)
            k = rope(k.reshape(T, self.Hkv, self.D), cos, sin, neox)
            v = v.reshape(T, self.Hkv, self.D)
            kvr = f32 if 'kv32' in flags else f16
            o = attention(q, kvr(k), kvr(v), flags, fa_rows).reshape(T, self.E)
            x = x + matmul(o, self.w(p + 'attn_output.weight'), flags)
            h = rmsnorm(x, self.vec(p + 'ffn_norm.weight'), self.eps)
            gt = matmul(h, self.w(p + 'ffn_gate.weight'), flags)
            up = matmul(h, self.w(p + 'ffn_up.weight'), flags)
            x = x + matmul(gt / (1 + np.exp(-gt)) * up, self.w(p + 'ffn_down.weight'), flags)
        h = rmsnorm(x, self.vec('output_norm.weight'), self.eps)
        return h

def ids(line):
    return [int(t) for t in line.split()]

def main():
    path, cases, outp = sys.argv[1:4]
    flags = set(sys.argv[4:])
    m = Model(path)
    lines = open(cases).read().split('\n')
    out = open(outp, 'w')
    ow = m.w('output.weight' if 'output.weight' in m.t else 'token_embd.weight')
    att = next((f[4:] for f in flags if f.startswith('att=')), 'f32')
    for c in range(0, len(lines) - 4, 5):
        name = lines[c]; prompt = ids(lines[c + 1]); gen = ids(lines[c + 2]); sidx = ids(lines[c + 3]); top = ids(lines[c + 4])
        seq = prompt + gen
        n = len(prompt) - 1 + len(gen)
        toks = seq[:n]
        rows = np.arange(n)
        if att == 'fa16all':
            fa_rows = np.ones(n, bool)
        else:  # prompt as one ubatch (tiled f32 FA if >= 64 queries), then single-token decodes
            fa_rows = (rows >= len(prompt)) | (len(prompt) < 64)
        h = m.forward(toks, flags, fa_rows)
        want = [len(prompt) - 1 + s for s in sidx]
        logits = matmul(h[want], ow, flags)
        for s in range(len(sidx)):
            lg = logits[s]; mx = lg.max(); lse = mx + np.log(np.exp(lg - mx).sum())
            out.write(f"{name} {s} " + ' '.join(f"{lg[t] - lse:.9f}" for t in top[s * 5:s * 5 + 5]) + "\n")
        out.flush()

if __name__ == '__main__':
    main()
