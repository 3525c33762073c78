"""Reference scale for trace.py: relative difference of the residual stream per layer
between the int8-activation forward and the exact (unquantized) forward, same input.
usage: trace2.py MODEL.gguf CASES [case_index]"""
import sys, numpy as np
sys.path.insert(0, __import__('os').path.dirname(__import__('os').path.abspath(__file__)))
import emul
m = emul.Model(sys.argv[1])
lines = open(sys.argv[2]).read().split('\n')
ci = int(sys.argv[3]) if len(sys.argv) > 3 else 0
toks = emul.ids(lines[5 * ci + 1]) + emul.ids(lines[5 * ci + 2])
T = len(toks)
orig = emul.rmsnorm
res = []
for flags in (set(), {'noquant'}):
    states = []
    def rms(x, w, eps, states=states):
        states.append(x.copy()); return orig(x, w, eps)
    emul.rmsnorm = rms
    m.forward(toks, flags, np.zeros(T, bool))
    res.append(states[1::2])
d = [np.linalg.norm(a - b) / np.linalg.norm(a) for a, b in zip(*res)]
print('int8 vs exact: ' + ' '.join(f'{x:.1e}' for x in d))
