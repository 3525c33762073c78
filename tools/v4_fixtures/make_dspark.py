#!/usr/bin/env python3
"""Random-weight DSpark support GGUFs for the DeepSeek V4 fixtures (numpy only: no torch, no
transformers, no gguf package).

A DSpark support file is the block drafter of a V4 target (antirez/ds4
`gguf-tools/deepseek4-quantize.c --dspark-only`, commit 1115603560fd400e7500d60ade8e578bb38205af):
the `mtp.*` stage tensors (each a V4 layer with sliding-window attention and learned
routing: no compressor, indexer or token->expert table), stage 0's `main_proj` / `main_norm`
that turn the captured target rows into the context, and on the last stage the final `norm`,
the `hc_head_*` collapse, the low-rank Markov head and the confidence projection, with the
metadata keys `deepseek4.dspark.{n_mtp_layers, block_size, noise_token_id, markov_rank,
target_layer_ids.0/.1/.2}` (u32 each). The target's embedding and output head are shared, so
the support file has none.

Shapes follow the target (hidden size, heads, q-LoRA, output groups, HC streams, experts) read
from the target GGUF. Types follow ds4's policy where the fixture's sizes allow it: norms,
scales, bases, sinks, the routing bias and the confidence projection F32; HC mixing, router
and Markov tables F16; attention projections, the shared expert and main_proj Q8_0 (every row
length here is a multiple of 32); routed experts F16 (Q4_K needs rows of 256, the fixture's are
64 and 32).

Run:  python make_dspark.py [DIR]   (default: crates/model/tests/fixtures/deepseek4)
It writes DIR/flash-layout.dspark.gguf and the `dspark` entry of DIR/manifest.json.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path

import numpy as np

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "crates" / "model" / "tests" / "fixtures" / "deepseek4"
DS4_COMMIT = "1115603560fd400e7500d60ade8e578bb38205af"

# One support file per entry: the target fixture it drafts for and its DSpark settings.
SUPPORTS = [
    {
        "name": "flash-layout.dspark",
        "target": "flash-layout",
        "seed": 4004,
        "n_stages": 3,
        "block_size": 5,
        "markov_rank": 16,
        # Flash: the last three of 43 layers (40, 41, 42); here the last three of 6.
        "target_layers": [3, 4, 5],
        # Flash's noise token is an unused id (128799); the fixture vocabulary has no spare
        # one, the last byte token stands in.
        "noise_token": 257,
    },
]

# ggml type ids.
F32, F16, Q8_0 = 0, 1, 8
ALIGN = 32

# ---------------------------------------------------------------------------------------
# GGUF reading (header, metadata, tensor table) and writing
# ---------------------------------------------------------------------------------------

SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class Reader:
    def __init__(self, data: bytes):
        self.d = data
        self.p = 0

    def take(self, fmt: str):
        v = struct.unpack_from(fmt, self.d, self.p)[0]
        self.p += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        s = self.d[self.p : self.p + n].decode("utf-8")
        self.p += n
        return s

    def value(self, t: int):
        if t == 8:
            return self.string()
        if t == 9:
            et = self.take("<I")
            n = self.take("<Q")
            return [self.value(et) for _ in range(n)]
        return self.take(SCALARS[t])


def read_gguf(path: Path):
    r = Reader(path.read_bytes())
    assert r.take("<4s") == b"GGUF"
    version = r.take("<I")
    assert version in (2, 3)
    n_tensors = r.take("<Q")
    n_kv = r.take("<Q")
    kv = {}
    for _ in range(n_kv):
        k = r.string()
        kv[k] = r.value(r.take("<I"))
    tensors = {}
    for _ in range(n_tensors):
        name = r.string()
        nd = r.take("<I")
        dims = [r.take("<Q") for _ in range(nd)]
        ggml_type = r.take("<I")
        r.take("<Q")
        tensors[name] = (dims, ggml_type)
    return kv, tensors


def put_string(out: bytearray, s: str):
    b = s.encode("utf-8")
    out += struct.pack("<Q", len(b)) + b


def put_kv(out: bytearray, key: str, value):
    put_string(out, key)
    if isinstance(value, str):
        out += struct.pack("<I", 8)
        put_string(out, value)
    elif isinstance(value, int):
        out += struct.pack("<II", 4, value)
    else:
        raise TypeError(key)


def pad(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def write_gguf(path: Path, kv: list, tensors: list):
    """kv: [(key, str|u32)]; tensors: [(name, dims ne0-first, ggml type, bytes)]."""
    out = bytearray(b"GGUF")
    out += struct.pack("<IQQ", 3, len(tensors), len(kv))
    for k, v in kv:
        put_kv(out, k, v)
    off = 0
    for name, dims, t, data in tensors:
        put_string(out, name)
        out += struct.pack("<I", len(dims))
        for d in dims:
            out += struct.pack("<Q", d)
        out += struct.pack("<IQ", t, off)
        off = pad(off + len(data))
    out += bytes(pad(len(out)) - len(out))
    for _, _, _, data in tensors:
        out += data
        out += bytes(pad(len(data)) - len(data))
    path.write_bytes(bytes(out))


# ---------------------------------------------------------------------------------------
# Encodings
# ---------------------------------------------------------------------------------------


def enc_f32(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<f4").tobytes()


def enc_f16(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<f2").tobytes()


def enc_q8_0(a: np.ndarray) -> bytes:
    """ggml Q8_0: blocks of 32 along the row, an f16 scale amax/127 and 32 int8 codes."""
    rows = np.ascontiguousarray(a, dtype=np.float32).reshape(-1, 32)
    amax = np.abs(rows).max(axis=1)
    d = (amax / 127.0).astype(np.float16)
    df = d.astype(np.float32)
    inv = np.where(df > 0, 1.0 / np.where(df > 0, df, 1.0), 0.0)
    q = np.clip(np.rint(rows * inv[:, None]), -127, 127).astype(np.int8)
    out = bytearray()
    for s, codes in zip(d, q):
        out += np.array([s], dtype="<f2").tobytes() + codes.tobytes()
    return bytes(out)


ENCODE = {F32: enc_f32, F16: enc_f16, Q8_0: enc_q8_0}


# ---------------------------------------------------------------------------------------
# The support file
# ---------------------------------------------------------------------------------------


def build(spec: dict, root: Path) -> dict:
    kv, ttab = read_gguf(root / f"{spec['target']}.gguf")
    m = lambda k: kv["deepseek4." + k]  # noqa: E731
    d = m("embedding_length")
    n_layer = m("block_count")
    heads = m("attention.head_count")
    hd = m("attention.key_length")
    q_lora = m("attention.q_lora_rank")
    groups = m("attention.output_group_count")
    o_rank = m("attention.output_lora_rank")
    n_exp = m("expert_count")
    f = m("expert_feed_forward_length")
    n_shared = kv.get("deepseek4.expert_shared_count", 0)
    hc = m("hyper_connection.count")
    vocab = ttab["output.weight"][0][1]
    layers = spec["target_layers"]
    assert all(0 <= i < n_layer for i in layers) and len(set(layers)) == len(layers)
    assert 0 <= spec["noise_token"] < vocab
    rank = spec["markov_rank"]
    mix = (2 + hc) * hc
    rng = np.random.default_rng(spec["seed"])

    tensors = []

    def add(name: str, dims: list, t: int, scale: float, offset: float = 0.0):
        # dims ne0 first; numpy holds the reverse (C order, last dim fastest = ne0).
        a = rng.standard_normal(tuple(reversed(dims))).astype(np.float32) * scale + offset
        if t == F16:
            a = a.astype(np.float16).astype(np.float32)
        tensors.append((name, dims, t, ENCODE[t](a)))

    n_t = len(layers)
    add("mtp.0.main_proj.weight", [n_t * d, d], Q8_0, (n_t * d) ** -0.5)
    add("mtp.0.main_norm.weight", [d], F32, 0.1, 1.0)
    for s in range(spec["n_stages"]):
        p = f"mtp.{s}."
        for block in ("hc_attn", "hc_ffn"):
            add(p + f"{block}_fn.weight", [hc * d, mix], F16, 0.02)
            add(p + f"{block}_base.weight", [mix], F32, 0.1)
            add(p + f"{block}_scale.weight", [3], F32, 0.1, 1.0)
        add(p + "attn_norm.weight", [d], F32, 0.1, 1.0)
        add(p + "attn_q_a.weight", [d, q_lora], Q8_0, d**-0.5)
        add(p + "attn_q_a_norm.weight", [q_lora], F32, 0.1, 1.0)
        add(p + "attn_q_b.weight", [q_lora, heads * hd], Q8_0, q_lora**-0.5)
        add(p + "attn_kv.weight", [d, hd], Q8_0, d**-0.5)
        add(p + "attn_kv_a_norm.weight", [hd], F32, 0.1, 1.0)
        add(p + "attn_sinks.weight", [heads], F32, 0.5)
        add(p + "attn_output_a.weight", [heads * hd // groups, groups * o_rank], Q8_0, (heads * hd // groups) ** -0.5)
        add(p + "attn_output_b.weight", [groups * o_rank, d], Q8_0, (groups * o_rank) ** -0.5)
        add(p + "ffn_norm.weight", [d], F32, 0.1, 1.0)
        add(p + "ffn_gate_inp.weight", [d, n_exp], F16, d**-0.5)
        add(p + "exp_probs_b.bias", [n_exp], F32, 0.05)
        if n_shared:
            add(p + "ffn_gate_shexp.weight", [d, f * n_shared], Q8_0, d**-0.5)
            add(p + "ffn_up_shexp.weight", [d, f * n_shared], Q8_0, d**-0.5)
            add(p + "ffn_down_shexp.weight", [f * n_shared, d], Q8_0, (f * n_shared) ** -0.5)
        add(p + "ffn_gate_exps.weight", [d, f, n_exp], F16, d**-0.5)
        add(p + "ffn_up_exps.weight", [d, f, n_exp], F16, d**-0.5)
        add(p + "ffn_down_exps.weight", [f, d, n_exp], F16, f**-0.5)
    last = f"mtp.{spec['n_stages'] - 1}."
    add(last + "norm.weight", [d], F32, 0.1, 1.0)
    add(last + "hc_head_fn.weight", [hc * d, hc], F16, 0.02)
    add(last + "hc_head_base.weight", [hc], F32, 0.1)
    add(last + "hc_head_scale.weight", [1], F32, 0.1, 1.0)
    add(last + "markov_head.markov_w1.weight", [rank, vocab], F16, 1.0)
    add(last + "markov_head.markov_w2.weight", [rank, vocab], F16, rank**-0.5)
    add(last + "confidence_head.proj.weight", [d + rank, 1], F32, (d + rank) ** -0.5)

    meta = [
        ("general.architecture", "deepseek4"),
        ("general.name", f"DSpark support for the {spec['target']} fixture (random weights)"),
        ("deepseek4.dspark.n_mtp_layers", spec["n_stages"]),
        ("deepseek4.dspark.block_size", spec["block_size"]),
        ("deepseek4.dspark.noise_token_id", spec["noise_token"]),
        ("deepseek4.dspark.markov_rank", rank),
    ] + [(f"deepseek4.dspark.target_layer_ids.{i}", x) for i, x in enumerate(layers)]
    path = root / f"{spec['name']}.gguf"
    write_gguf(path, meta, tensors)
    blob = path.read_bytes()
    types = {F32: "F32", F16: "F16", Q8_0: "Q8_0"}
    return {
        "name": spec["name"],
        "gguf": path.name,
        "target": spec["target"],
        "gguf_sha256": hashlib.sha256(blob).hexdigest(),
        "gguf_bytes": len(blob),
        "weight_seed": spec["seed"],
        "ds4_commit": DS4_COMMIT,
        "metadata": dict(meta),
        "tensors": [{"name": n, "dims": dims, "type": types[t]} for n, dims, t, _ in tensors],
    }


def main() -> int:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR
    entries = [build(s, root) for s in SUPPORTS]
    manifest_path = root / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["dspark"] = {
        "about": "DSpark support files for the fixtures; made by tools/v4_fixtures/make_dspark.py",
        "supports": entries,
    }
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    for e in entries:
        print(f"{e['gguf']}: {e['gguf_bytes']} B, {len(e['tensors'])} tensors, sha256 {e['gguf_sha256']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
