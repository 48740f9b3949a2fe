"""This machine, as far as it decides what a pass costs: the CPU's model name and the vector and matrix
flags that choose kernels, the cores this process may use, the architecture. Torch-free: `deploy/`
reads it too (docs/architecture.md §1)."""

import os
import platform
from pathlib import Path

KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "neon", "sve")


def machine() -> dict:
    """The CPU (model name, the vector and matrix flags that choose kernels), the cores this process
    may use, and the architecture: two machines that agree on these run a pass alike."""
    name, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            field, _, value = line.partition(":")
            if field.strip() == "model name":
                name = value.strip()
            elif field.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": name, "flags": sorted(flags.intersection(KERNEL_FLAGS)), "cores": cores, "arch": platform.machine()}
