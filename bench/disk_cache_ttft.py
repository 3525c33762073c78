#!/usr/bin/env python3
"""Time to first token of a long agent-style prompt through `lockstep serve`: cold, warm in
RAM (the same server again), and after a restart of the server, read back from the prompt
cache on disk (`--disk-cache`).

The prompt has the shape of a Codex CLI request: a long system prompt, tool definitions
(the chat template renders them) and a short user turn. Each request asks for one token at
temperature 0, so its wall time is the time to first token. The three answers must be the
same token; the script fails otherwise. Before the restart the page cache is dropped when
the script may (root), so the restore reads from the device. Nothing leaves this machine (127.0.0.1 only).

  bench/disk_cache_ttft.py --model qwen2.5-coder-1.5b --tokens 8000
  bench/disk_cache_ttft.py --model qwen2.5-coder-0.5b --tokens 2000 --lockstep target/release/lockstep
  bench/disk_cache_ttft.py --model model.gguf --tokens 8000 --device cuda --lockstep BIN/lockstep
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

SYSTEM_HEAD = """You are a coding agent running in a terminal-based coding assistant. You are \
expected to be precise, safe, and helpful. You can receive user prompts and other context \
provided by the harness, such as files in the workspace; communicate with the user by \
streaming thinking and responses, and by making and updating plans; emit function calls to \
run terminal commands and apply patches.
"""

SECTIONS = [
    "How you work: keep going until the query is completely resolved before ending your turn. "
    "Only terminate your turn when you are sure that the problem is solved. Autonomously "
    "resolve the query to the best of your ability, using the tools available to you.",
    "Planning: use the plan tool to keep an up-to-date, step-by-step plan for the task. A plan "
    "has short steps of at most five to seven words each, with a status for each step. Do not "
    "repeat the full contents of the plan after a call; summarise the change instead.",
    "Editing constraints: default to ASCII when editing or creating files. Add succinct code "
    "comments only where the code is not self-explanatory. Never revert changes you did not "
    "make unless the user explicitly asks you to; the workspace may be dirty.",
    "Testing: if the codebase has tests or the ability to build or run, consider using them "
    "to verify that your work is complete. Start as specific as possible to the code you "
    "changed so that you catch issues efficiently, then make your way to broader tests.",
    "Sandboxing and approvals: commands run in a sandbox that restricts the filesystem and "
    "the network. When a command fails because of the sandbox, ask for approval to rerun it "
    "outside, with a one-sentence justification of why it is needed.",
    "Presenting your work: your final message should read naturally, like an update from a "
    "concise teammate. Reference files with their paths and line numbers, do not dump large "
    "files, and offer logical next steps such as running the tests or committing.",
]


def tools(n):
    out = []
    for i in range(n):
        out.append({
            "type": "function",
            "function": {
                "name": f"tool_{i}_" + ["shell", "apply_patch", "read_file", "update_plan",
                                        "search", "list_dir", "view_image"][i % 7],
                "description": SECTIONS[i % len(SECTIONS)],
                "parameters": {
                    "type": "object",
                    "properties": {
                        "command": {"type": "array", "items": {"type": "string"},
                                    "description": "The command and its arguments."},
                        "workdir": {"type": "string",
                                    "description": "The working directory of the command."},
                        "timeout_ms": {"type": "integer",
                                       "description": "Time limit in milliseconds."},
                        "justification": {"type": "string",
                                          "description": "Why the command needs approval."},
                    },
                    "required": ["command"],
                },
            },
        })
    return out


def body(n_sections, n_tools):
    system = SYSTEM_HEAD + "\n".join(
        f"## Section {i + 1}\n{SECTIONS[i % len(SECTIONS)]}" for i in range(n_sections))
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "The test `parses_empty_input` in src/lib.rs fails. "
                                        "Find out why and fix it."},
        ],
        "tools": tools(n_tools),
        "max_tokens": 1,
        "temperature": 0,
    }


def post(port, path, payload, timeout):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def get(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return r.read().decode()


def start(args, cache_dir, port):
    cmd = [args.lockstep, "serve", "-m", args.model, "--port", str(port), "--device", args.device,
           "--ctx-size", str(args.ctx), "--disk-cache", cache_dir]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if "serving" not in line:
        p.kill()
        sys.exit(f"server did not start: {line}{p.stderr.read()}")
    return p


def stop(p):
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    return p.stderr.read()


def timed(port, payload, timeout):
    t0 = time.perf_counter()
    r = post(port, "/v1/chat/completions", payload, timeout)
    dt = time.perf_counter() - t0
    u = r["usage"]
    return dt, u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], \
        r["choices"][0]["message"]


def drop_page_cache():
    """Writes the page cache back and drops it (root only); whether it was dropped."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def disk_metrics(port):
    out = {}
    for line in get(port, "/metrics").splitlines():
        if line.startswith("lockstep_disk_cache_") and not line.startswith("#"):
            k, v = line.split()
            out[k] = float(v)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--tokens", type=int, default=8000, help="prompt size to aim for")
    ap.add_argument("--ctx", type=int, default=9216)
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--lockstep", default="target/release/lockstep")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per request")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the server's --device)")
    args = ap.parse_args()
    # About 10 tokens per tool-definition line, 55 per section: aim for --tokens.
    n_tools = max(4, args.tokens // 400)
    n_sections = max(4, (args.tokens - n_tools * 230) // 60)
    payload = body(n_sections, n_tools)
    payload["model"] = args.model
    cache_dir = tempfile.mkdtemp(prefix="lockstep-disk-bench-")
    rows = []
    try:
        load0 = os.getloadavg()
        p = start(args, cache_dir, args.port)
        try:
            cold = timed(args.port, payload, args.timeout)
            warm = timed(args.port, payload, args.timeout)
        finally:
            err1 = stop(p)
        dropped = drop_page_cache()
        p = start(args, cache_dir, args.port)
        try:
            disk = timed(args.port, payload, args.timeout)
            m = disk_metrics(args.port)
        finally:
            err2 = stop(p)
        load1 = os.getloadavg()
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    for name, r in [("cold", cold), ("warm in RAM", warm), ("after restart, from disk", disk)]:
        rows.append((name, r))
    if not (cold[3] == warm[3] == disk[3]):
        sys.exit(f"answers differ: {cold[3]} / {warm[3]} / {disk[3]}")
    print(f"model {args.model}, prompt {cold[1]} tokens, load average "
          f"{load0[0]:.1f} before, {load1[0]:.1f} after, {os.cpu_count()} cores")
    print("| run | TTFT (s) | cached tokens | ratio to cold |")
    print("| --- | ---: | ---: | ---: |")
    for name, (dt, _, cached, _) in rows:
        print(f"| {name} | {dt:.3f} | {cached} | {dt / cold[0]:.4f} |")
    read = m.get("lockstep_disk_cache_restored_bytes_total", 0.0)
    secs = m.get("lockstep_disk_cache_restore_seconds_total", 0.0)
    busy = m.get("lockstep_disk_cache_read_seconds_total", 0.0)
    rate = f"{read / 1e9 / secs:.2f} GB/s" if secs > 0 else "n/a"
    where = ("the page cache was dropped before the restart: read from the device"
             if dropped else
             "the page cache could not be dropped (not root?): the files were just written, "
             "so mostly read from RAM")
    print(f"disk: {int(m.get('lockstep_disk_cache_hit_blocks_total', 0))} blocks, "
          f"{read / 1e6:.1f} MB restored (read, checked, copied into the KV pool) in "
          f"{secs:.3f} s ({rate}; {where}); the reader threads' summed read+check time "
          f"{busy:.3f} s")
    print("start-up lines:", [l for l in (err1 + err2).splitlines() if "disk cache" in l])


if __name__ == "__main__":
    main()
