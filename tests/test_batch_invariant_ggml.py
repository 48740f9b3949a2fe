"""scripts/batch_invariant_ggml/: the patches scripts/setup.sh builds into llama-cpp-python's ggml-cpu
(issue 50). The llama.cpp engine's first exact setting rests on them (model/llama_cpp_exactness.py);
tests/test_real_llama_cpp.py checks the model level."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")
HERE = Path(__file__).resolve().parents[1] / "scripts" / "batch_invariant_ggml"


def test_the_installed_q4_k_gemm_gives_each_row_what_the_one_row_gemv_gives_it():
    """check_gemm.py calls the installed library's two kernels directly: every one of 20 rows (the
    gemm's 16-row and 4-row paths) over 72 columns (its AVX-512 and AVX2 paths) bit-equal to the gemv.
    Unpatched ggml gets 0 of 20 (the script's docstring)."""
    result = subprocess.run([sys.executable, HERE / "check_gemm.py"], capture_output=True, text=True)
    assert result.returncode == 0, f"is the patched ggml-cpu installed? (scripts/setup.sh)\n{result.stdout}"
    assert "gemm row == gemv: 20 of 20 rows (largest difference 0)" in result.stdout


def test_the_install_is_the_cached_build_and_a_second_run_changes_nothing(tmp_path):
    """build.sh --install copies the build kept in the cache over the binding's library, once: run
    again it builds nothing and leaves the installed file alone (setup.sh runs it every time)."""
    import llama_cpp

    installed = Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"
    before = installed.stat().st_mtime_ns
    result = subprocess.run(["bash", HERE / "build.sh", "--install"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "building" not in result.stdout and "installed in" in result.stdout
    assert installed.stat().st_mtime_ns == before
