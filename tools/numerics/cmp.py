import json, sys
# usage: cmp.py golden.json dumpA [dumpB]  -> max and mean over steps of the per-step max
# |dlogprob| over the ref top-5 (as crates/model/tests/model/common.rs); A vs golden, or A vs B
def load(p):
    r = {}
    for l in open(p):
        f = l.split(); r[(f[0], int(f[1]))] = list(map(float, f[2:7]))
    return r
g = json.load(open(sys.argv[1]))
ref = {(c['name'], i): [t[1] for t in s['top']] for c in g['cases'] for i, s in enumerate(c['steps'])}
a = load(sys.argv[2])
b = load(sys.argv[3]) if len(sys.argv) > 3 else ref
errs = []; worst = None
for k in ref:
    e = max(abs(x - y) for x, y in zip(a[k], b[k])); errs.append(e)
    if worst is None or e > worst[0]: worst = (e, k)
print(f"max {max(errs):.4f} mean {sum(errs)/len(errs):.4f} n {len(errs)} worst {worst[1]}")
