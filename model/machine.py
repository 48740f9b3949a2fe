"""This machine, as far as it decides what a pass costs: the CPU's model name and the vector and matrix
flags that choose kernels, the cores this process may use, the architecture. The one reader of
/proc/cpuinfo for the model package; torch-free, so `deploy/` reads it too (docs/architecture.md §1)."""

import functools
import os
import platform
from pathlib import Path

KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "neon", "sve")


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first processor's block ends here; the others repeat it
            name, _, value = line.partition(":")
            fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_name() -> str:
    """The CPU's model name ("" where /proc/cpuinfo does not say)."""
    return _cpuinfo().get("model name", "")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (avx2, avx512_bf16, amx_tile, ...)."""
    return set(_cpuinfo().get("flags", "").split())


def machine() -> dict:
    """The CPU (model name, the vector and matrix flags that choose kernels), the cores this process
    may use, and the architecture: two machines that agree on these run a pass alike."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu_name() or platform.processor(),
        "flags": sorted(cpu_flags().intersection(KERNEL_FLAGS)),
        "cores": cores,
        "arch": platform.machine(),
    }
