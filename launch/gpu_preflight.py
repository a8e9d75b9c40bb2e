"""The GPU checks' first step, seconds long: is this a machine they can pass on? Exits 1 naming every reason not.

    python launch/gpu_preflight.py --gpus 2

What a cold GPU machine lacks shows here instead of minutes into a step: a C compiler and Python.h (Triton
builds its launcher with them on the first compiled kernel), /dev/shm (NCCL's intra-node transport and
DeepSpeed's buffers; a container's 64 MiB default fails them), and CUDA, the GPU count and NCCL in this torch
(a CPU torch would otherwise let the scripts pass: GPU tests skip, training falls back to gloo).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile


def compile_smoke() -> list[str]:
    """Build a one-function C extension against Python.h, as Triton does; the reasons it cannot."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return ["no C compiler (cc/gcc on PATH or $CC): Triton cannot build its kernel launcher"]
    include = sysconfig.get_paths()["include"]
    if not os.path.isfile(os.path.join(include, "Python.h")):
        return [f"no Python.h in {include} (install the python dev headers): Triton cannot build its launcher"]
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "smoke.c")
        with open(src, "w") as f:
            f.write("#include <Python.h>\nint smoke(void) { return Py_IsInitialized(); }\n")
        try:
            r = subprocess.run([cc, "-shared", "-fPIC", "-O1", f"-I{include}", src, "-o", src[:-2] + ".so"],
                               capture_output=True, text=True, timeout=5)
        except subprocess.TimeoutExpired:
            return [f"{cc} did not compile a 2-line extension within 5 s"]
    return [] if r.returncode == 0 else [f"{cc} failed on a 2-line extension: {r.stderr.strip()[-300:]}"]


def shm_reasons(min_gib: float) -> list[str]:
    """/dev/shm present and at least `min_gib` large."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return ["no /dev/shm: NCCL's intra-node transport needs it"]
    size = st.f_frsize * st.f_blocks / 2**30
    return [] if size >= min_gib else [f"/dev/shm is {size:.2f} GiB, under {min_gib} GiB (docker: --shm-size)"]


def torch_reasons(gpus: int) -> list[str]:
    """CUDA available in this torch, at least `gpus` devices, NCCL built in."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        build = f"a CPU build, torch {torch.__version__}" if torch.version.cuda is None else \
            f"torch {torch.__version__} built for CUDA {torch.version.cuda} sees no device"
        return [f"torch.cuda.is_available() is False ({build})"]
    out = []
    if torch.cuda.device_count() < gpus:
        out.append(f"{torch.cuda.device_count()} CUDA device(s), this check needs {gpus}")
    if not dist.is_nccl_available():
        out.append("torch.distributed has no NCCL backend")
    if not out:
        names = [torch.cuda.get_device_name(i) for i in range(gpus)]
        print(f"torch {torch.__version__} CUDA {torch.version.cuda} NCCL {torch.cuda.nccl.version()}: {names}")
    return out


def main() -> int:
    """Run every check; print one line per failure and exit 1 if any."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=1, help="CUDA devices the check needs (default 1)")
    ap.add_argument("--shm-gib", type=float, default=1.0, help="smallest /dev/shm accepted, GiB (default 1)")
    args = ap.parse_args()
    reasons = compile_smoke() + shm_reasons(args.shm_gib) + torch_reasons(args.gpus)
    for r in reasons:
        print(f"preflight: {r}", file=sys.stderr)
    if not reasons:
        print("preflight: C compiler, Python.h, /dev/shm, CUDA, device count and NCCL ok")
    return 1 if reasons else 0


if __name__ == "__main__":
    sys.exit(main())
