"""Is a position's result independent of the call it runs in, on this CPU's llama.cpp kernels? (issue 50)

`--exactness bitwise` scores every kept position through ggml's one-row kernel (calls of at most 3
positions), because a matmul of 4 rows or more takes the gemm kernel, whose sums differ from the
one-row gemv's. Under load that costs about twice the gemm per row. If the gemm's result for a row
did not depend on how many rows share the call (batch invariance), every call could be padded to 4
rows and run through the gemm exactly. This script checks that on the default target and times both:

  .venv/bin/python scripts/measure_batch_invariance.py docs/results/batch_invariance_zen5.json

It loads the target on the llama.cpp engine (repacked weights, `bitwise`), opens SESSIONS sessions of
CONTEXT prompt tokens, then compares logits bit for bit: one row alone (gemv) against the first row of a
4-row call (gemm); the first row of a 4-, 8- and 16-row call of one session; and n sessions' rows in one
call against each session's row in a 4-row call of its own. Timings: medians of 5.
"""

import json
import statistics
import sys
import time

import torch

from specd.model.engine import Row
from specd.model.loading import load_engine
from specd.model.machine import machine
from specd.proto.limits import Limits

SESSIONS = 16
CONTEXT = 200


def main(out: str) -> None:
    engine = load_engine(
        "target",
        "target",
        threads=2,
        engine="llama.cpp",
        limits=Limits(max_sessions=SESSIONS, max_session_tokens=1024, max_cached_tokens=SESSIONS * 1024),
    )
    ids = [f"s{i}" for i in range(SESSIONS)]
    for i, session in enumerate(ids):
        engine.forward([Row(session, [(13 * j + 7 * i + 1) % 30000 for j in range(CONTEXT)], 1)])

    def token(i: int, k: int) -> int:
        return (97 * i + 31 * k + 5) % 30000

    def run(rows: list[Row], call_tokens: int) -> list[torch.Tensor]:
        engine.call_tokens = call_tokens
        out = engine.forward(rows)
        for row in rows:
            engine.crop(row.session_id, CONTEXT)
        return out

    def timed(rows: list[Row], call_tokens: int) -> float:
        times = []
        for _ in range(5):
            started = time.perf_counter()
            run(rows, call_tokens)
            times.append(time.perf_counter() - started)
        return round(statistics.median(times) * 1000, 1)

    def alone(i: int, n: int) -> Row:
        return Row(ids[i], [token(i, k) for k in range(n)], n)

    def across(n: int) -> list[Row]:
        return [Row(ids[i], [token(i, 0)], 1) for i in range(n)]

    gemm4 = run([alone(0, 4)], 512)[0][0]
    equal = {
        "one row (gemv) == row 0 of a 4-row call (gemm)": torch.equal(run([alone(0, 1)], 3)[0][0], gemm4),
        "row 0 of an 8-row call == of a 4-row call": torch.equal(run([alone(0, 8)], 512)[0][0], gemm4),
        "row 0 of a 16-row call == of a 4-row call": torch.equal(run([alone(0, 16)], 512)[0][0], gemm4),
    }
    for n in (4, 5, 8, 16):
        rows = run(across(n), 512)
        own = [run([Row(ids[i], [token(i, 0), 1, 2, 3], 4)], 512)[0][0] for i in range(n)]
        same = [torch.equal(row[0], mine) for row, mine in zip(rows, own)]
        equal[f"{n} sessions' rows in one call == each in a 4-row call of its own"] = f"{sum(same)} of {n}"
    timings = {
        "one row, gemv": timed([alone(0, 1)], 3),
        "one session, 4 rows, gemm": timed([alone(0, 4)], 512),
        **{f"{n} sessions x 1 row, calls of 3 (gemv)": timed(across(n), 3) for n in (4, 8, 16)},
        **{f"{n} sessions x 1 row, one call (gemm)": timed(across(n), 512) for n in (4, 8, 16)},
    }
    report = {"machine": machine(), "context": CONTEXT, "bit_equal": equal, "milliseconds": timings}
    print(json.dumps(report, indent=1))
    with open(out, "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "batch_invariance.json")
