"""Perturbation growth through the layers: the same forward twice, the second with the
embedding scaled by (1 + 2^-23) (one f32 ulp), printing the relative difference of the
residual stream after each layer. With int8 activation quantization vs without.
usage: trace.py MODEL.gguf CASES [case_index] [flags...]"""
import sys, numpy as np
sys.path.insert(0, __import__('os').path.dirname(__import__('os').path.abspath(__file__)))
import emul
m = emul.Model(sys.argv[1])
lines = open(sys.argv[2]).read().split('\n')
ci = int(sys.argv[3]) if len(sys.argv) > 3 else 0
extra = set(sys.argv[4:])
toks = emul.ids(lines[5 * ci + 1]) + emul.ids(lines[5 * ci + 2])
T = len(toks)
hs = {}
orig_rms = emul.rmsnorm
for label, flags in [('int8 act quant', set() | extra), ('no quant (f32 act)', {'noquant'} | extra)]:
    res = []
    for pert in (0.0, 2.0 ** -23):
        states = []
        def rms(x, w, eps, states=states):
            states.append(x.copy()); return orig_rms(x, w, eps)
        emul.rmsnorm = rms
        emb = m.w('token_embd.weight')
        saved = emb.dq
        emb.dq = (saved.astype(np.float64) * (1 + pert))
        m.forward(toks, flags, np.ones(T, bool) if 'att=fa' in flags else np.zeros(T, bool))
        emb.dq = saved
        res.append(states[1::2])  # residual stream before each ffn norm ... take every 2nd
    emul.rmsnorm = orig_rms
    d = [np.linalg.norm(a - b) / np.linalg.norm(a) for a, b in zip(*res)]
    print(label + ': ' + ' '.join(f'{x:.1e}' for x in d))
