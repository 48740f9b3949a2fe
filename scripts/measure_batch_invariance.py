#!/usr/bin/env python
"""Which of ggml-cpu's matmul kernels score a position alike in every call, and at what cost? (issue 50)

`--exactness bitwise` scores every kept position through the one-row kernel (calls of at most 3
positions), because a call of more rows takes another kernel, whose sums differ. Under load that
costs about twice the gemm per row. A kernel whose result for a row does not depend on the rows
beside it (batch invariance) would let `bitwise` batch as `batched` does. The default target's
weights (Q4_K and Q6_K) can take four kernels in llama-cpp-python's ggml, by how they are loaded
and two of ggml's environment switches (read once per process, so each runs in a process of its own):

  repacked   llama.cpp's default (`use_extra_bufts`): weights interleaved at load; gemv up to 3
             rows, a 4-row gemm from 4 on
  plain      weights as stored: the one-row vec_dot up to 7 rows, the tiled K-quant matmul from 8
  vec_dot    plain, GGML_CPU_TILED_MM=0: the one-row vec_dot for every row, whatever the call
  tiled      plain, GGML_CPU_TILED_MM_FORCE=1: the tiled matmul for every call, one row too
  patched    with --patched-lib DIR (scripts/batch_invariant_ggml/build.sh's folder): repacked, with ggml's
             Q4_K gemm summing each super-block as the gemv does, and GGML_CPU_TILED_MM=0 (the Q6_K
             weights, not repacked on x86, through the one-row vec_dot whatever the call)

For each, on the default target with SESSIONS sessions of CONTEXT prompt tokens: bit for bit, the
first position of a one-session call of 4, 8 and 16 positions against the same position alone, and n
sessions' rows in one call against each alone; and medians of 5 of one call of n sessions x 1 row
(decode steps; also in calls of 3, as `bitwise` runs them) and of n sessions x 4 rows (verifies of 3
guesses). Writes a JSON and a plot:

  .venv/bin/python scripts/measure_batch_invariance.py docs/results/batch_invariance_kernels_zen5 \
      [--patched-lib /tmp/specd-ggml-batch-invariant]
"""

import json
import os
import statistics
import subprocess
import sys
import time

KERNELS = {
    "repacked": (True, {}),
    "plain": (False, {}),
    "vec_dot": (False, {"GGML_CPU_TILED_MM": "0"}),
    "tiled": (False, {"GGML_CPU_TILED_MM_FORCE": "1"}),
    # with --patched-lib only, which adds LLAMA_CPP_LIB_PATH
    "patched": (True, {"GGML_CPU_TILED_MM": "0"}),
}
SESSIONS = 32
CONTEXT = 200
COUNTS = (1, 2, 4, 8, 16, 32)


def measure(kernel: str) -> dict:
    """The figures of one kernel, in this process (its environment already set)."""
    import torch

    import specd.model.llama_cpp_exactness as llama_cpp_exactness
    from specd.model.engine import Row
    from specd.model.loading import load_engine
    from specd.proto.limits import Limits

    repacked = KERNELS[kernel][0]
    llama_cpp_exactness.EXACT_SETTINGS = ((repacked, 1),)  # the load's probe at one position a call: kept as is
    engine = load_engine(
        "target",
        "target",
        threads=2,
        engine="llama.cpp",
        limits=Limits(max_sessions=SESSIONS, max_session_tokens=1024, max_cached_tokens=SESSIONS * 1024),
    )
    assert engine.repacked == repacked, f"no {kernel} weights here (the probe found them inexact, or ggml has AMX)"
    engine.call_tokens = 512  # every kept position of a pass in one call
    ids = [f"s{i}" for i in range(SESSIONS)]
    for i, session in enumerate(ids):
        engine.forward([Row(session, [(13 * j + 7 * i + 1) % 30000 for j in range(CONTEXT)], 1)])

    def rows(sessions: int, positions: int) -> list[Row]:
        tokens = [[(97 * i + 31 * k + 5) % 30000 for k in range(positions)] for i in range(sessions)]
        return [Row(ids[i], tokens[i], positions) for i in range(sessions)]

    def run(call: list[Row]) -> list[torch.Tensor]:
        out = engine.forward(call)
        for row in call:
            engine.crop(row.session_id, CONTEXT)
        return out

    def timed(call: list[Row]) -> float:
        times = []
        for _ in range(5):
            started = time.perf_counter()
            run(call)
            times.append(time.perf_counter() - started)
        return round(statistics.median(times) * 1000, 1)

    alone = [run(rows(SESSIONS, 1)[i : i + 1])[0][0] for i in range(SESSIONS)]
    equal = {f"first of {n} positions of one session": torch.equal(run(rows(1, n))[0][0], alone[0]) for n in (4, 8, 16)}
    for n in COUNTS[1:]:
        together = run(rows(n, 1))
        equal[f"{n} sessions in one call"] = sum(torch.equal(a[0], b) for a, b in zip(together, alone))
    report = {"bit_equal_to_alone": equal, "ms_decode_steps": {n: timed(rows(n, 1)) for n in COUNTS}}
    engine.call_tokens = 3  # as `bitwise` runs the repacked weights
    report["ms_decode_steps_in_calls_of_3"] = {n: timed(rows(n, 1)) for n in COUNTS}
    engine.call_tokens = 512
    return {
        **report,
        "ms_verifies_of_4": {n: timed(rows(n, 4)) for n in COUNTS if n <= 16},
    }


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2))
    for kernel, figures in report["kernels"].items():
        steps = figures["ms_decode_steps"]
        counts = [int(n) for n in steps]
        equal = figures["bit_equal_to_alone"]
        invariant = all(v if isinstance(v, bool) else v == int(k.split()[0]) for k, v in equal.items())
        label = f"{kernel} ({'batch-invariant' if invariant else 'rows depend on the call'})"
        axes.plot(counts, [steps[n] / int(n) for n in steps], marker="o", label=label)
        if kernel == "repacked":  # the exact setting `bitwise` takes: the same weights, calls of 3
            thirds = figures["ms_decode_steps_in_calls_of_3"]
            label = "repacked in calls of 3 (bitwise today)"
            axes.plot(counts, [thirds[n] / int(n) for n in thirds], marker="o", ls="--", label=label)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("sessions in one llama_decode call (one decode step each)")
    axes.set_ylabel("ms per row")
    axes.set_title(f"ggml-cpu matmul kernels, default target, {report['machine']['cpu']}, 2 threads")
    axes.legend(fontsize=8)
    axes.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(out: str, patched_lib: str | None) -> None:
    from specd.model.machine import machine

    report = {"machine": machine(), "context": CONTEXT, "kernels": {}}
    for kernel, (_, env) in KERNELS.items():
        if kernel == "patched":
            if not patched_lib:
                continue
            env = {**env, "LLAMA_CPP_LIB_PATH": patched_lib}
        print(f"measuring {kernel} ...", flush=True)
        child = subprocess.run(
            [sys.executable, __file__, "--kernel", kernel],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=True,
        )
        report["kernels"][kernel] = json.loads(child.stdout.strip().splitlines()[-1])
        print(json.dumps(report["kernels"][kernel]), flush=True)
    with open(f"{out}.json", "w") as handle:
        json.dump(report, handle, indent=1)
    plot(report, f"{out}.png")
    print(f"wrote {out}.json and {out}.png")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--kernel"]:
        print(json.dumps(measure(sys.argv[2])))
    else:
        patched = sys.argv[sys.argv.index("--patched-lib") + 1] if "--patched-lib" in sys.argv else None
        main(sys.argv[1] if len(sys.argv) > 1 else "batch_invariance", patched)
