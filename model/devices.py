"""Where a model computes: choosing the device for a role, and what the device has (docs/architecture.md §4).

`auto`: the target takes a GPU when one is visible (a Ray actor with `num_gpus` sees exactly the
GPUs Ray assigned it, as cuda:0..); the draft stays on the CPU, the "cheap device", unless it is
given a GPU by name. bfloat16 is the default dtype on a GPU (model/loading.py: default_dtype).
"""

import ctypes
import ctypes.util
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specd.model.machine import cpu_name

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


class DeviceUnavailable(ValueError):
    """The device asked for does not exist here (the command line prints it in one line, exit 2)."""


def resolve_device(role: str, choice: str = "auto") -> torch.device:
    """The device a `role` ("draft" or "target") service runs on, for `--device choice`."""
    choice = (choice or "auto").strip().lower()
    if choice == "auto":
        return torch.device("cuda:0" if role == "target" and torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(choice)
    except RuntimeError:
        raise DeviceUnavailable(f"unknown device {choice!r}: choose {DEVICE_CHOICES}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise DeviceUnavailable(f"unsupported device {choice!r}: choose {DEVICE_CHOICES}")
    if not torch.cuda.is_available():
        raise DeviceUnavailable(
            f"--device {choice}: no CUDA GPU is visible here (torch {torch.__version__}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use --device cpu or auto"
        )
    index = device.index if device.index is not None else 0
    if index >= torch.cuda.device_count():
        raise DeviceUnavailable(f"--device {choice}: only {torch.cuda.device_count()} CUDA GPU(s) are visible")
    return torch.device("cuda", index)


@dataclass(frozen=True)
class DeviceMemory:
    name: str  # "NVIDIA H200", or the CPU's model name
    total_bytes: int
    free_bytes: int


def device_memory(device: torch.device) -> DeviceMemory:
    """The device's name and memory now (a CPU reports the host's memory)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(torch.cuda.get_device_name(device), total, free)
    return DeviceMemory(cpu_name() or "cpu", *_host_memory())


def _host_memory() -> tuple[int, int]:
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        kib = lambda key: int(fields[key].split()[0]) * 1024  # noqa: E731
        return kib("MemTotal"), kib("MemAvailable")
    except (OSError, KeyError, ValueError):
        return 0, 0


# Of the device memory free after loading, the share the KV cache may take when no
# --max-cached-tokens is given (the rest: activations, CUDA graphs, allocator slack).
KV_SHARE_OF_FREE_MEMORY = 0.8


def kv_token_budget(device: torch.device, bytes_per_token: int) -> int | None:
    """Cached tokens that fit in the device's free memory; None on a CPU (the limit's default holds)."""
    if device.type != "cuda" or bytes_per_token <= 0:
        return None
    return int(device_memory(device).free_bytes * KV_SHARE_OF_FREE_MEMORY) // bytes_per_token


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def trim_host_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim).

    A service's freed KV caches, logits and messages can stay in glibc's arenas: a tiny target's
    RSS once grew 12.6 % over 200 soak requests (tests/test_soak.py) with every session released.
    The services call this when their last session ends, so an idle service holds only what it
    uses. Measured on a tiny target after 400 mixed verifies: 0.8-7 ms, 43 ms the first time (with
    the most to return); nothing while sessions are live.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
