#!/usr/bin/env python
"""Does ggml's x86 gemm for repacked Q4_K weights give a row bit for bit what the one-row gemv gives it?

Calls the two kernels of a libggml-cpu directly (ctypes): random weights in the repacked layout
(block_q4_Kx8), 72 columns (the AVX-512 gemm takes 16 at a time, the last 8 its AVX2 path), 20 rows
of activations (the gemm takes 16 rows at a time, then 4), each quantized alone for the gemv
(quantize_row_q8_K) and in fours for the gemm (ggml_quantize_mat_t<8, Q8_K>); checks the quantized
activations' scales agree, then the outputs. Exit status 0 when every row is bit-equal.

  .venv/bin/python scripts/batch_invariant_ggml/check_gemm.py                      (the binding's own)
  .venv/bin/python scripts/batch_invariant_ggml/check_gemm.py /tmp/specd-ggml-batch-invariant   (build.sh's)
"""

import ctypes
import importlib.util
import sys
from pathlib import Path

import numpy as np

K, COLUMNS, ROWS = 1536, 72, 20  # values a row (6 super-blocks of 256), weight rows, activation rows
SUPER_BLOCKS = K // 256
Q4_KX8_BYTES = 16 + 16 + 96 + 1024  # half d[8], half dmin[8], scales[96], qs[1024]
Q8_K_BYTES = 4 + 256 + 32  # float d, qs[256], int16 bsums[16]
Q8_KX4_BYTES = 16 + 1024 + 128  # float d[4], qs[1024], int16 bsums[64]
QUANTIZE_4_ROWS = "_Z19ggml_quantize_mat_tILl8EL9ggml_type15EEvPKfPvll"  # ggml_quantize_mat_t<8, GGML_TYPE_Q8_K>


def pointer(array: np.ndarray) -> ctypes.c_void_p:
    return array.ctypes.data_as(ctypes.c_void_p)


def main(folder: str | None, seed: int = 0) -> bool:
    if folder is None:
        folder = str(Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib")
    ggml = ctypes.CDLL(str(Path(folder) / "libggml-cpu.so"))
    ggml.ggml_cpu_init()
    rng = np.random.default_rng(seed)

    def halves(n: int, low: float, high: float) -> np.ndarray:
        return rng.uniform(low, high, n).astype(np.float16).view(np.uint8)

    weights = np.concatenate(
        [
            np.concatenate(
                [
                    halves(8, 0.001, 0.01),
                    halves(8, 0.0005, 0.005),
                    rng.integers(0, 256, 96 + 1024, dtype=np.uint8),
                ]
            )
            for _ in range(COLUMNS // 8 * SUPER_BLOCKS)
        ]
    )
    x = (rng.standard_normal((ROWS, K)) * rng.uniform(0.2, 3, (ROWS, 1))).astype(np.float32)

    together = np.zeros((ROWS // 4, SUPER_BLOCKS * Q8_KX4_BYTES), np.uint8)  # four rows at a time, as ggml does
    for four in range(ROWS // 4):
        rows = np.ascontiguousarray(x[4 * four : 4 * four + 4])
        getattr(ggml, QUANTIZE_4_ROWS)(pointer(rows), pointer(together[four]), ctypes.c_int64(4), ctypes.c_int64(K))
    gemm = np.zeros((ROWS, COLUMNS), np.float32)
    ggml.ggml_gemm_q4_K_8x8_q8_K(
        ctypes.c_int(K), pointer(gemm), ctypes.c_size_t(COLUMNS), pointer(weights), pointer(together), ROWS, COLUMNS
    )
    scales_agree, rows_equal, largest = [], [], 0.0
    for row in range(ROWS):
        alone = np.zeros(SUPER_BLOCKS * Q8_K_BYTES, np.uint8)
        ggml.quantize_row_q8_K(pointer(x[row]), pointer(alone), ctypes.c_int64(K))
        gemv = np.zeros(COLUMNS, np.float32)
        ggml.ggml_gemv_q4_K_8x8_q8_K(
            ctypes.c_int(K), pointer(gemv), ctypes.c_size_t(COLUMNS), pointer(weights), pointer(alone), 1, COLUMNS
        )
        d_alone = alone.reshape(SUPER_BLOCKS, Q8_K_BYTES)[:, :4].copy().view(np.float32).ravel()
        d_together = together[row // 4].reshape(SUPER_BLOCKS, Q8_KX4_BYTES)[:, :16].copy().view(np.float32)[:, row % 4]
        scales_agree.append(bool(np.array_equal(d_alone, d_together)))
        rows_equal.append(bool(np.array_equal(gemv, gemm[row])))
        largest = max(largest, float(np.abs(gemv - gemm[row]).max()))
    print(f"{folder}/libggml-cpu.so")
    print(f"  activations' scales agree: {sum(scales_agree)} of {ROWS} rows")
    print(f"  gemm row == gemv: {sum(rows_equal)} of {ROWS} rows (largest difference {largest:g})")
    return all(rows_equal)


if __name__ == "__main__":
    sys.exit(0 if main(sys.argv[1] if len(sys.argv) > 1 else None) else 1)
