"""Issue 39's scaling figure from scripts/measure_sim_pool.sh's results (every figure simulated):
output tokens/s against target replicas, beside linear scaling from one replica, and TTFT p50.
Prints the markdown table the docs carry.

    .venv/bin/python scripts/plot_sim_pool.py docs/results 1 2 4 8 16
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(folder: Path, counts: list[int]) -> None:
    runs = {n: json.loads((folder / f"sim_pool_{n}_replicas.json").read_text())["runs"][0] for n in counts}
    one = runs[counts[0]]["output_tokens_per_s"] / counts[0]
    print("| target + draft replicas | streams | tok/s (simulated) | × one replica | TTFT p50 |")
    print("|---|---|---|---|---|")
    for n, run in runs.items():
        rate = run["output_tokens_per_s"]
        print(f"| {n} | {run['concurrency']} | {rate:.1f} | {rate / one:.1f}× | {run['p50_ttft_ms']:.0f} ms |")
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(counts, [runs[n]["output_tokens_per_s"] for n in counts], "o-", label="specd (simulated)")
    left.plot(counts, [one * n for n in counts], "--", color="grey", label="linear from one replica")
    left.set(xlabel="target replicas (one draft replica each)", ylabel="output tokens/s", title="Throughput")
    left.legend()
    right.plot(counts, [runs[n]["p50_ttft_ms"] for n in counts], "o-")
    right.set(xlabel="target replicas", ylabel="ms", title="TTFT p50", ylim=(0, None))
    for axes in (left, right):
        axes.set_xticks(counts)
        axes.grid(alpha=0.3)
    figure.suptitle("Replica pools on the simulated engine (GPU profile): 8 streams per replica")
    figure.tight_layout()
    figure.savefig(folder / "sim_pool.png", dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]), [int(n) for n in sys.argv[2:]] or [1, 8, 16])
