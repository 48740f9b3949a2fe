"""MKL's fast kernels on an AMD CPU (model/cpu_blas.py): a model service's process runs again with
the one-line library preloaded, and float32 matmuls give the same results to rounding."""

import json
import os
import subprocess
import sys

import pytest

from specd.model.cpu_blas import LIBRARY, is_amd_cpu, shim

amd_only = pytest.mark.skipif(not is_amd_cpu(), reason="the shim is for AMD CPUs; elsewhere MKL's kernels are fast")

CHILD = f"""
import json, os
import torch
from specd.model.cpu_blas import preload_on_amd
preload_on_amd()  # executes this script again, preloaded, unless SPECD_MKL_AMD=0
torch.manual_seed(0)
x, w = torch.randn(8, 1536), torch.randn(1536, 8960)
maps = open("/proc/self/maps").read()
print(json.dumps({{"preloaded": "{LIBRARY}" in maps, "product": (x @ w)[:, :64].tolist()}}))
"""


def run_child(tmp_path, **environment) -> dict:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    result = subprocess.run(
        [sys.executable, str(script)], env={**os.environ, **environment}, capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


@amd_only
def test_a_process_runs_again_with_the_shim_and_computes_the_same(tmp_path):
    import torch

    assert shim() is not None and shim().name == LIBRARY  # built once into the cache, then reused
    fast, slow = run_child(tmp_path), run_child(tmp_path, SPECD_MKL_AMD="0")
    assert fast["preloaded"] and not slow["preloaded"]
    torch.testing.assert_close(torch.tensor(fast["product"]), torch.tensor(slow["product"]), rtol=1e-4, atol=1e-3)


def test_off_or_not_amd_the_process_goes_on_unchanged(tmp_path):
    assert not run_child(tmp_path, SPECD_MKL_AMD="0")["preloaded"]
    if not is_amd_cpu():
        assert not run_child(tmp_path)["preloaded"]
