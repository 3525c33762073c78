#!/usr/bin/env python3
"""Compile lockstep's CUDA kernels with NVRTC on a machine without a GPU.

The CUDA backend compiles crates/backend-cuda/src/kernels.cu at run time with NVRTC, so a
kernel that does not compile is only found on a GPU machine. NVRTC itself needs no GPU and
no driver: this script takes it from the `nvidia-cuda-nvrtc-cu12` wheel on PyPI (downloaded
once into ~/.cache/lockstep/nvrtc), compiles the kernels with the backend's options
(device.rs NVRTC_OPTIONS) to a cubin for each architecture asked for, and prints the
compiler log and, per kernel, ptxas's registers, spills and shared memory.

    python3 tools/cuda/nvrtc_check.py                      # sm_90 and sm_80, summary
    python3 tools/cuda/nvrtc_check.py --arch sm_90 --kernels att_scores,matvec_q4_k
    python3 tools/cuda/nvrtc_check.py --all                # every kernel's ptxas line

Exit status 0 when every architecture compiles, 1 otherwise.
"""
import argparse
import ctypes
import os
import re
import subprocess
import sys
import zipfile

WHEEL = "nvidia-cuda-nvrtc-cu12==12.9.86"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE = os.path.join(ROOT, "crates", "backend-cuda", "src", "kernels.cu")
# The backend's options (crates/backend-cuda/src/device.rs, NVRTC_OPTIONS).
OPTIONS = ["--fmad=false", "--prec-div=true", "--prec-sqrt=true", "--ftz=false"]


def nvrtc_library() -> str:
    cache = os.path.join(os.path.expanduser("~"), ".cache", "lockstep", "nvrtc")
    lib = os.path.join(cache, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.12")
    if os.path.exists(lib):
        return lib
    os.makedirs(cache, exist_ok=True)
    print(f"downloading {WHEEL} from PyPI into {cache} ...", file=sys.stderr)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--platform", "manylinux_2_12_x86_64", "--python-version", "3", "-d", cache, WHEEL],
        check=True,
    )
    wheels = [f for f in os.listdir(cache) if f.endswith(".whl")]
    if not wheels:
        sys.exit("no NVRTC wheel was downloaded")
    with zipfile.ZipFile(os.path.join(cache, wheels[0])) as z:
        z.extractall(cache)
    return lib


def compile_for(lib, src: bytes, arch: str, ptxas_verbose: bool):
    prog = ctypes.c_void_p()
    r = lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"kernels.cu", 0, None, None)
    if r != 0:
        sys.exit(f"nvrtcCreateProgram failed ({r})")
    opts = OPTIONS + [f"--gpu-architecture={arch}"]
    if ptxas_verbose:
        opts.append("--ptxas-options=-v")
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    r = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return r, log.value.decode(errors="replace")


def kernel_table(log: str):
    """(kernel, registers, spill stores, spill loads, static smem) per entry function."""
    rows, name, spills = [], None, (0, 0)
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            name = m.group(1)
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            spills = (int(m.group(1)), int(m.group(2)))
            continue
        m = re.search(r"Used (\d+) registers.*?(?:, (\d+) bytes smem)?$", line)
        if m and name:
            rows.append((name, int(m.group(1)), spills[0], spills[1], int(m.group(2) or 0)))
            name = None
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90,sm_80", help="comma-separated sm_XX or compute_XX")
    ap.add_argument("--kernels", default="", help="comma-separated kernel names to print")
    ap.add_argument("--all", action="store_true", help="print every kernel's registers")
    a = ap.parse_args()
    lib = ctypes.CDLL(nvrtc_library())
    src = open(SOURCE, "rb").read()
    want = [k for k in a.kernels.split(",") if k]
    ok = True
    for arch in a.arch.split(","):
        r, log = compile_for(lib, src, arch, arch.startswith("sm_"))
        diag = [l for l in log.splitlines() if "error" in l or "warning" in l]
        print(f"{arch}: {'compiled' if r == 0 else f'FAILED ({r})'}")
        for l in diag:
            print("  " + l)
        if r != 0:
            print(log[-4000:])
            ok = False
            continue
        table = kernel_table(log)
        spilling = [t for t in table if t[2] or t[3]]
        print(f"  {len(table)} kernels; spilling: {', '.join(t[0] for t in spilling) or 'none'}")
        for t in table:
            if a.all or t[0] in want:
                print(f"  {t[0]:32s} {t[1]:4d} registers, spills {t[2]}/{t[3]} bytes, {t[4]} bytes static smem")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
