"""What one target pass costs with each KV layout, side by side (issue 21): per-session DynamicCaches
copied into a padded batch each pass (model/batch.py), against sessions that stay in static rows
(model/static_slot.py, eager on a CPU), at several batch sizes, context lengths and new tokens per row;
for the padded batch also its parts (the copies in and back, the forward): where a pass's time goes.

    .venv/bin/python scripts/measure_kv_layout.py --out docs/results/kv_layout.json
"""

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from specd.model.batch import PaddedBatch
from specd.model.devices import device_memory
from specd.model.engine import Row
from specd.model.loading import load_model
from specd.model.transformers_engine import TransformersEngine


def pass_seconds(engine, batch: int, context: int, new_tokens: int, repeats: int) -> dict[str, float]:
    """Median seconds of one pass (B sessions of `context` tokens, `new_tokens` each), and for the
    padded batch its parts: the copy into the padded cache, the forward, the copy back."""
    sessions = [f"s{index}" for index in range(batch)]
    for index, session in enumerate(sessions):
        engine.forward([Row(session, [(1000 + 7 * index + j) % 30000 for j in range(context)], 0)])
    times: dict[str, list[float]] = {"pass": [], "copy_in": [], "forward": [], "copy_back": []}
    for _ in range(repeats + 1):
        rows = [Row(session, [11 + j for j in range(new_tokens)], new_tokens) for session in sessions]
        started = time.perf_counter()
        if engine.slots is None and batch > 1:  # the padded batch, step by step (what engine.forward does)
            with torch.inference_mode():
                padded = PaddedBatch(engine.loaded, {session: engine.caches[session] for session in sessions})
                copied = time.perf_counter()
                padded.forward(rows)
                forwarded = time.perf_counter()
                padded.write_back()
            times["copy_in"].append(copied - started)
            times["forward"].append(forwarded - copied)
            times["copy_back"].append(time.perf_counter() - forwarded)
        else:
            engine.forward(rows)
        times["pass"].append(time.perf_counter() - started)
        for session in sessions:
            engine.crop(session, context)
    for session in sessions:
        engine.release(session)
    return {name: statistics.median(values[1:]) for name, values in times.items() if values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="target")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--contexts", default="200,1000")
    parser.add_argument("--new-tokens", default="1,5")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layouts", default="padded_batch,static_rows", help="which of the two to measure")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    loaded = load_model(args.model, args.dtype)
    engines = {"padded_batch": TransformersEngine(loaded), "static_rows": TransformersEngine(loaded, graphs=True)}
    engines = {name: engine for name, engine in engines.items() if name in args.layouts.split(",")}
    results = []
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            for new_tokens in map(int, args.new_tokens.split(",")):
                row = {"context": context, "batch": batch, "new_tokens": new_tokens}
                for name, engine in engines.items():
                    parts = pass_seconds(engine, batch, context, new_tokens, args.repeats)
                    row[f"{name}_ms"] = 1000 * parts.pop("pass")
                    row |= {f"{name}_{part}_ms": 1000 * seconds for part, seconds in parts.items()}
                if len(engines) == 2:
                    row["static_over_padded"] = row["static_rows_ms"] / row["padded_batch_ms"]
                results.append(row)
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    report = {
        "cpu": device_memory(torch.device("cpu")).name,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": loaded.name,
        "dtype": str(loaded.dtype),
        "passes": results,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
