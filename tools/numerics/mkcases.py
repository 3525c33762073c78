import json, sys
sys.path.insert(0, '/root/.cache/lockstep/peers/llama.cpp-0.3.36/src/llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py')
import gguf
# usage: mkcases.py golden.json model.gguf > cases.txt
# per case: name / prompt ids / generated ids (with hidden UTF-8 tokens recovered, as
# crates/model/tests/model/common.rs generated_sequence does) / for each step its index in
# generated / ref top-5 ids per step
def byte_decoder():
    bs = list(range(ord("!"), ord("~")+1)) + list(range(ord("¡"), ord("¬")+1)) + list(range(ord("®"), ord("ÿ")+1))
    cs = bs[:]; n = 0
    for b in range(256):
        if b not in bs: bs.append(b); cs.append(256+n); n += 1
    return {chr(c): b for b, c in zip(bs, cs)}
d = json.load(open(sys.argv[1]))
r = gguf.GGUFReader(sys.argv[2])
f = r.fields['tokenizer.ggml.tokens']; toks = [bytes(f.parts[i]).decode('utf-8') for i in f.data]
f = r.fields['tokenizer.ggml.token_type']; types = [int(f.parts[i][0]) for i in f.data]
bd = byte_decoder()
vb = [bytes(bd.get(ch, 0) for ch in t) if types[i] != 3 else b'' for i, t in enumerate(toks)]
ctrl = [t == 3 for t in types]
for c in d['cases']:
    text = c['completion_text'].encode(); at = 0; seq = []; stepidx = []
    # tools/golden/make.py reports every generated token: nothing hidden to recover.
    if len(c['steps']) == len(c['completion_tokens']):
        seq, stepidx = list(c['completion_tokens']), list(range(len(c['steps'])))
    for t in ([] if seq else c['completion_tokens']):
        b = vb[t]
        if not ctrl[t]:
            rest = text[min(at, len(text)):]
            fits = lambda r: r.startswith(b) or b.startswith(r)
            if not fits(rest):
                k = next(k for k in range(1, len(rest)+1) if fits(rest[k:]))
                miss = rest[:k]
                while miss:
                    cand = [(len(v), -i, i) for i, v in enumerate(vb) if v and miss.startswith(v)]
                    _, _, hid = max(cand); seq.append(hid); miss = miss[len(vb[hid]):]
                at += k
            at += len(b)
        stepidx.append(len(seq)); seq.append(t)
    print(c['name']); print(' '.join(map(str, c['prompt_tokens']))); print(' '.join(map(str, seq)))
    print(' '.join(map(str, stepidx)))
    print(' '.join(str(t[0]) for s in c['steps'] for t in s['top']))
