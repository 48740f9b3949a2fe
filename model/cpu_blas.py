"""MKL's fast matmul kernels on an AMD CPU, for a model service's process.

torch's CPU wheel runs float32 matmuls in Intel MKL, which picks its kernels by the CPU's vendor:
on an AMD CPU it takes a slow generic path, although the CPU has the AVX2 and FMA those kernels
need. One token's decode (a matrix-vector product, bound by memory) hardly notices; everything
with several rows does: a batched pass, a verify of K + 1 tokens, a prefill. Measured on an AMD
EPYC (Zen 2, AVX2 only, 2 threads): an [8, 1536] x [1536, 8960] matmul 23 -> 8 ms; the 1.5B
target in float32, an 8-stream decode pass 1.62 -> 0.75 s, a 5-token verify 1.48 -> 0.65 s, a
24-token prefill 1.76 -> 1.16 s, a 1-token decode 0.49 -> 0.42 s. bfloat16 passes (oneDNN) do not
change. The remedy known from NumPy and MATLAB on AMD: MKL asks one internal function,
mkl_serv_intel_cpu_true, whether the CPU is Intel's, and a one-line library preloaded into the
process answers yes. MKL then runs its AVX2 kernels, with the same results to rounding.

`specd serve draft|target` calls `preload_on_amd()` first: on an AMD CPU it builds that library
once (the C compiler, into the model cache) and executes itself again with it in LD_PRELOAD (the
dynamic loader reads it only when a process starts). SPECD_MKL_AMD=0 turns it off; without a
compiler it logs a warning and runs as before. Ray actors (`specd up --ray-address`) do not get
it yet. No torch here: this runs before anything loads.
"""

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from specd.model.store import cache_root

log = logging.getLogger(__name__)

SOURCE = "int mkl_serv_intel_cpu_true(void) { return 1; }\n"
LIBRARY = "libspecd_mkl_amd.so"


def is_amd_cpu() -> bool:
    try:
        return any(line.split(":")[-1].strip() == "AuthenticAMD" for line in _cpuinfo() if line.startswith("vendor_id"))
    except OSError:
        return False


def _cpuinfo() -> list[str]:
    return Path("/proc/cpuinfo").read_text().splitlines()


def shim() -> Path | None:
    """The library, built once into the cache (None: no compiler, or the build failed)."""
    path = cache_root() / "lib" / LIBRARY
    if path.exists():
        return path
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler: MKL keeps its slow kernels on this AMD CPU (float32 passes ~2x slower)")
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as folder:
        source, built = Path(folder) / "shim.c", Path(folder) / LIBRARY
        source.write_text(SOURCE)
        result = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", built, source], capture_output=True)
        if result.returncode:
            log.warning("could not build %s: %s", LIBRARY, result.stderr.decode(errors="replace").strip())
            return None
        built.replace(path)  # atomic: a service starting beside this one sees the whole file or none
    return path


def preload_on_amd() -> None:
    """On an AMD CPU, execute this process again with the library preloaded; returns otherwise."""
    preloaded = os.environ.get("LD_PRELOAD", "")
    if os.environ.get("SPECD_MKL_AMD") == "0" or LIBRARY in preloaded or not sys.platform.startswith("linux"):
        return
    if not is_amd_cpu() or (path := shim()) is None:
        return
    environment = dict(os.environ, LD_PRELOAD=f"{path} {preloaded}".strip())
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)
