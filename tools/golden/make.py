#!/usr/bin/env python3
"""tools/golden/make.py — regenerates lockstep's golden reference data (see README.md beside it).

    python3 tools/golden/make.py [all|continuations|tokenizer|templates|exact] [--models A,B]

- continuations: greedy continuations with the top-5 log-probs of every step, from llama.cpp
  (the one vendored in the llama-cpp-python sdist, CPU, built by `bench/compare.sh
  --build-only --llama-only`, linked into `llama_ref.cpp`), into crates/model/tests/data/golden/.
  Each prompt is tokenized with the model's own BOS rule (`tokenizer.ggml.add_bos_token`);
  `gemma3-270m-nobos.json` repeats the short prompts without the BOS on purpose (the oracle
  test of golden_gemma3.rs).
- tokenizer: llama.cpp's tokenization (no BOS, control tokens parsed) of every string of
  crates/text/tests/data/golden/strings.json.
- exact: the f64 oracle of the no-BOS gemma3 prompts (gemma3_exact.py, numpy) into
  crates/model/tests/data/golden/gemma3-270m-exact.json, from gemma3-270m-nobos.json.
- templates: every conversation of crates/chat/tests/data/golden/<model>.json rendered again by
  HF transformers (`render_jinja_template`, what `apply_chat_template` calls) from the
  template stored in the model's GGUF.

Inputs (prompts, strings, conversations) are the committed files; outputs are rewritten in
place, each with a "provenance" record (script, command, versions, settings). Models come
through lockstep's cache (`lockstep pull`). Python packages go into a venv under the peers
cache ($LOCKSTEP_HOME/peers/golden-venv), nothing is installed system-wide.
"""
import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MODEL_DATA = REPO / "crates/model/tests/data/golden"
TEXT_DATA = REPO / "crates/text/tests/data/golden"
CHAT_DATA = REPO / "crates/chat/tests/data/golden"

LLAMA_CPP_PYTHON_VERSION = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")
# The llama.cpp commit that llama-cpp-python 0.3.36 vendors (its CHANGELOG).
LLAMA_CPP_COMMIT = {"0.3.36": "0c1e57098"}
# Pinned so that a rerun renders with the same code; bump deliberately.
VENV_PACKAGES = ["transformers==5.25.0", "jinja2==3.1.6", "numpy==2.4.6"]

# (model, prompts file, output file, BOS policy). "model" follows tokenizer.ggml.add_bos_token.
CONTINUATIONS = [
    ("smollm2-135m", "prompts.json", "smollm2-135m.json", "model"),
    ("smollm2-135m", "prompts-long.json", "long-smollm2-135m.json", "model"),
    ("qwen2.5-coder-0.5b", "prompts.json", "qwen2.5-coder-0.5b.json", "model"),
    ("qwen2.5-coder-1.5b", "prompts.json", "qwen2.5-coder-1.5b.json", "model"),
    ("qwen2.5-coder-1.5b", "prompts-long.json", "long-qwen2.5-coder-1.5b.json", "model"),
    ("gemma3-270m", "prompts.json", "gemma3-270m.json", "model"),
    ("gemma3-270m", "prompts-long.json", "long-gemma3-270m.json", "model"),
    ("gemma3-270m", "prompts.json", "gemma3-270m-nobos.json", "none"),
]
# (model whose tokenizer is used, output file): the two Qwen2.5-Coder models share one.
TOKENIZERS = [("smollm2-135m", "smollm2-135m.json"), ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b.json"),
              ("gemma3-270m", "gemma3-270m.json")]
TEMPLATES = ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
# Tokens generated per prompt unless the prompt gives its own "n".
N_PREDICT = 48


def log(msg):
    print(f"make.py: {msg}", file=sys.stderr, flush=True)


def die(msg):
    log(f"error: {msg}")
    sys.exit(1)


def cache_root():
    """The cache root lockstep and bench/compare.sh use."""
    if os.environ.get("LOCKSTEP_HOME"):
        return Path(os.environ["LOCKSTEP_HOME"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "lockstep"
    return Path.home() / ".cache/lockstep"


PEER_DIR = cache_root() / "peers" / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"
BUILD_DIR = PEER_DIR / "build"
SRC_DIR = PEER_DIR / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor/llama.cpp"


def run(cmd, **kw):
    log("$ " + " ".join(shlex.quote(str(c)) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def write(path, obj, rows_key):
    """Compact JSON, one row of `obj[rows_key]` per line (readable diffs)."""
    head = {k: v for k, v in obj.items() if k != rows_key}
    dump = lambda v: json.dumps(v, ensure_ascii=False, separators=(",", ":"))
    lines = [dump(head)[:-1] + f',"{rows_key}":[']
    rows = obj[rows_key]
    lines += [dump(r) + ("," if i + 1 < len(rows) else "") for i, r in enumerate(rows)]
    lines.append("]}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    log(f"wrote {path.relative_to(REPO)} ({path.stat().st_size} bytes)")


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# The reference implementations
# ----------------------------------------------------------------------------------------------

def llama_ref():
    """Builds the peer llama.cpp through bench/compare.sh, then links llama_ref.cpp to it."""
    run(["bash", REPO / "bench/compare.sh", "--build-only", "--llama-only"])
    libs = [BUILD_DIR / p for p in ("src/libllama.a", "ggml/src/libggml.a", "ggml/src/libggml-cpu.a",
                                    "ggml/src/libggml-base.a")]
    for lib in libs:
        if not lib.is_file():
            die(f"{lib} missing: the peer build did not produce its static libraries")
    exe = PEER_DIR / "golden" / "llama_ref"
    src = HERE / "llama_ref.cpp"
    if not exe.is_file() or exe.stat().st_mtime < max(p.stat().st_mtime for p in [src, *libs]):
        exe.parent.mkdir(parents=True, exist_ok=True)
        cxx = os.environ.get("CXX", "g++")
        run([cxx, "-O2", "-std=c++17", src, f"-I{SRC_DIR}/include", f"-I{SRC_DIR}/ggml/include",
             f"-I{SRC_DIR}/vendor", "-o", exe, *libs, "-fopenmp", "-lpthread", "-ldl"])
    return exe


def peer_provenance():
    variant = ""
    configure = BUILD_DIR / "configure.log"
    if configure.is_file():
        variant = next((l.strip().lstrip("- ") for l in configure.read_text().splitlines()
                        if "Adding CPU backend variant" in l), "")
    commit = LLAMA_CPP_COMMIT.get(LLAMA_CPP_PYTHON_VERSION, "see the sdist's CHANGELOG.md")
    return (f"llama.cpp {commit} as vendored in the PyPI sdist llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}, "
            f"CPU build of `bench/compare.sh --build-only --llama-only` ({variant}), "
            f"linked into tools/golden/llama_ref.cpp")


def venv_python():
    """A venv with the pinned Python packages (created once, in the peers cache)."""
    venv = cache_root() / "peers" / "golden-venv"
    py = venv / "bin/python"
    stamp = venv / "golden-packages.txt"
    if not py.exists():
        run([sys.executable, "-m", "venv", venv])
    if not stamp.is_file() or stamp.read_text() != "\n".join(VENV_PACKAGES):
        pip_args = shlex.split(os.environ.get("LOCKSTEP_PIP_ARGS", ""))
        run([py, "-m", "pip", "install", "--quiet", *pip_args, *VENV_PACKAGES])
        stamp.write_text("\n".join(VENV_PACKAGES))
    return py


def lockstep_cmd():
    """How to run lockstep: $LOCKSTEP_BIN, a built binary, or cargo."""
    if os.environ.get("LOCKSTEP_BIN"):
        return [os.environ["LOCKSTEP_BIN"]]
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    for profile in ("release", "debug"):
        if (target / profile / "lockstep").is_file():
            return [target / profile / "lockstep"]
    return ["cargo", "run", "--quiet", "--release", "-p", "lockstep-cli", "--"]


def model_file(name, _cache={}):
    """The cached GGUF of a model, pulled through lockstep when absent."""
    if name not in _cache:
        path = cache_root() / "models" / f"{name}.gguf"
        if not path.is_file():
            run([*lockstep_cmd(), "pull", name], cwd=REPO)
        if not path.is_file():
            die(f"lockstep pull {name} left no {path}")
        _cache[name] = (path, sha256(path))
    return _cache[name]


def provenance(args, reference, **extra):
    return {"script": "tools/golden/make.py",
            "command": " ".join(["python3", "tools/golden/make.py", *map(shlex.quote, args.argv)]),
            "reference": reference, **extra}


def model_record(name):
    path, digest = model_file(name)
    return {"name": name, "file": path.name, "sha256": digest}


# ----------------------------------------------------------------------------------------------
# The references
# ----------------------------------------------------------------------------------------------

def continuations(args, models):
    exe = llama_ref()
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "passive"))
    for model, prompts_file, out_file, bos in CONTINUATIONS:
        if model not in models:
            continue
        prompts = json.loads((MODEL_DATA / prompts_file).read_text())
        n = max(p.get("n", N_PREDICT) for p in prompts)
        with tempfile.TemporaryDirectory() as tmp:
            inp, out = Path(tmp) / "in.json", Path(tmp) / "out.json"
            inp.write_text(json.dumps([{"name": p["name"], "text": p["text"], "n": p.get("n", N_PREDICT)} for p in prompts]))
            run([exe, "generate", model_file(model)[0], inp, out, *(["--no-bos"] if bos == "none" else [])],
                env=env)
            got = json.loads(out.read_text())
        for case in got["cases"]:
            for step in case["steps"]:
                step["logprob"] = round(step["logprob"], 6)
                step["top"] = [[i, round(lp, 6)] for i, lp in step["top"]]
        bos_rule = ("BOS added, as the GGUF's tokenizer.ggml.add_bos_token asks" if got["add_bos"] else
                    "no BOS, as the GGUF's tokenizer.ggml.add_bos_token asks" if bos == "model" else
                    "no BOS on purpose (--no-bos), against the model's tokenizer.ggml.add_bos_token")
        write(MODEL_DATA / out_file, {
            "provenance": provenance(
                args, peer_provenance(), model=model_record(model), prompts=prompts_file,
                settings=(f"greedy, up to {n} tokens (stops after an end-of-generation token); prompt "
                          f"text tokenized with control tokens parsed, {bos_rule}; prompt in batches "
                          f"of 2048 (ubatch 512) then one token per llama_decode; n_ctx 4096, KV f16, "
                          f"flash attention auto, 2 threads; log-probs: f64 log-softmax of the f32 "
                          f"logits over the full vocabulary, rounded to 1e-6")),
            "model": model, "add_bos": got["add_bos"], "cases": got["cases"]}, "cases")


def tokenizer(args, models):
    exe = llama_ref()
    strings = TEXT_DATA / "strings.json"
    for model, out_file in TOKENIZERS:
        if model not in models:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out.json"
            run([exe, "tokenize", model_file(model)[0], strings, out])
            tokens = json.loads(out.read_text())
        write(TEXT_DATA / out_file, {
            "provenance": provenance(
                args, peer_provenance(), model=model_record(model),
                settings="llama_tokenize of each string of strings.json (same order): no BOS/EOS "
                         "added, control tokens in the text parsed"),
            "model": model, "tokens": tokens}, "tokens")


def templates(args, models):
    py = venv_python()
    # The gguf-py of the same llama.cpp tree reads the GGUF (the sdist is unpacked by compare.sh).
    run(["bash", REPO / "bench/compare.sh", "--build-only", "--llama-only"])
    for model in TEMPLATES:
        if model not in models:
            continue
        path = CHAT_DATA / f"{model}.json"
        cases = json.loads(path.read_text())["cases"]
        inputs = [{k: v for k, v in c.items() if k != "rendered"} for c in cases]
        with tempfile.TemporaryDirectory() as tmp:
            inp, out = Path(tmp) / "in.json", Path(tmp) / "out.json"
            inp.write_text(json.dumps(inputs))
            run([py, HERE / "render_templates.py", SRC_DIR / "gguf-py", model_file(model)[0], inp, out],
                env=dict(os.environ, TRANSFORMERS_VERBOSITY="error"))
            got = json.loads(out.read_text())
        write(path, {
            "provenance": provenance(
                args, f"HF transformers {got['transformers']} (PyPI), render_jinja_template as "
                      f"apply_chat_template calls it", model=model_record(model),
                settings="the template is the GGUF's tokenizer.chat_template; bos_token and "
                         "eos_token are the GGUF's BOS/EOS token strings; each case's messages, "
                         "tools and add_generation_prompt as given"),
            "model": model, "cases": got["cases"]}, "cases")


def exact(args, models):
    if "gemma3-270m" not in models:
        return
    py = venv_python()
    run(["bash", REPO / "bench/compare.sh", "--build-only", "--llama-only"])  # gguf-py's sources
    golden, out = MODEL_DATA / "gemma3-270m-nobos.json", MODEL_DATA / "gemma3-270m-exact.json"
    run([py, HERE / "gemma3_exact.py", model_file("gemma3-270m")[0], golden, out],
        env=dict(os.environ, PYTHONPATH=str(SRC_DIR / "gguf-py")))
    got = json.loads(out.read_text())
    out.write_text(json.dumps({
        "provenance": provenance(
            args, "tools/golden/gemma3_exact.py: f64 forward over the dequantized weights (gguf-py "
                  "of the same llama.cpp tree, numpy), exact GELU-tanh, no KV rounding, no "
                  "activation quantization", model=model_record("gemma3-270m"),
            settings="teacher-forced on prompt_tokens + completion_tokens[:-1] of "
                     "gemma3-270m-nobos.json; per step the exact log-probs of llama.cpp's top-5 "
                     "ids, the exact argmax and its top-2 gap"),
        **got}, separators=(",", ":")) + "\n")
    log(f"wrote {out.relative_to(REPO)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", default="all", choices=["all", "continuations", "tokenizer", "templates", "exact"])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b,gemma3-270m",
                    help="comma-separated models to regenerate (default: all four)")
    args = ap.parse_args()
    args.argv = sys.argv[1:]
    models = set(args.models.split(","))
    known = {m for m, *_ in CONTINUATIONS} | set(TEMPLATES)
    if models - known:
        die(f"unknown model(s) {sorted(models - known)}; known: {sorted(known)}")
    if args.what in ("all", "continuations"):
        continuations(args, models)
    if args.what in ("all", "tokenizer"):
        tokenizer(args, models)
    if args.what in ("all", "templates"):
        templates(args, models)
    if args.what in ("all", "exact"):
        exact(args, models)


if __name__ == "__main__":
    main()
