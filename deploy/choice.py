"""The configuration `specd bench --configurations` measured fastest on this machine for a model pair,
kept in the model cache, and what `specd up` (and every local stack: `specd generate`, `specd bench`)
runs when its flags leave the engine and the drafter to it.

Which engine and drafter serve fastest depends on the CPU more than on anything specd can guess: on
an AVX2 or AVX-512 EPYC with 2 cores the llama.cpp target alone (verifying costs what decoding does),
on an Intel Xeon with AMX the bf16 transformers engine with a draft. `--engine auto` picks llama.cpp
for a GGUF on a CPU by rule; once the bench has measured this machine, its fastest configuration
with K chosen every step is the default instead (the target-only rows are the reference it is
compared with; K = 0 is one of the choices the chooser makes every step in each of them).
`--engine`, `--draft-engine` or `--drafter` given by hand win over it; `SPECD_CHOICE=off` in the
environment ignores it (the test suite's stacks run so).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

FORMAT = 1


@dataclass(frozen=True)
class Choice:
    engine: str  # llama.cpp or transformers, both services'
    drafter: str  # hybrid, model, ngram or suffix (the last two: no draft service)
    tokens_per_s: float
    default_tokens_per_s: float | None  # the rule's default (llama.cpp hybrid) in the same run
    measured: float  # when (time.time())

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d", time.localtime(self.measured))
        versus = (
            f", {self.tokens_per_s / self.default_tokens_per_s:.2f}× the rule's llama.cpp hybrid"
            if self.default_tokens_per_s
            else ""
        )
        return (
            f"--engine {self.engine} --drafter {self.drafter}: the fastest `specd bench --configurations` "
            f"measured on this machine ({when}, {self.tokens_per_s:.1f} tok/s{versus})"
        )


def _path(draft_model: str, target_model: str) -> tuple[Path, dict]:
    from specd.model.machine import machine  # the model package, torch-free parts: only when called
    from specd.model.store import kept_path

    key = {"machine": machine(), "draft": draft_model, "target": target_model}
    return kept_path("choice", key), key


def save(report: dict, draft_model: str, target_model: str) -> Choice | None:
    """Keep the fastest configuration of a `specd bench --configurations` report that chooses K every
    step (not a target-only reference row); None if it measured none."""
    results = {name: result for name, result in report["results"].items() if result["drafter"] != "target-only"}
    if not results:
        return None
    best = max(results.values(), key=lambda result: result["tokens_per_s"] or 0.0)
    default = report["results"].get(report.get("default") or "", {})
    choice = Choice(best["engine"], best["drafter"], best["tokens_per_s"], default.get("tokens_per_s"), time.time())
    from specd.model.store import write_json

    path, key = _path(draft_model, target_model)
    write_json(path, {"format": FORMAT, "key": key, "choice": choice.__dict__})
    return choice


def load(draft_model: str, target_model: str) -> Choice | None:
    """The kept choice for this machine and pair, if the bench measured one (none with SPECD_CHOICE=off)."""
    if os.environ.get("SPECD_CHOICE") == "off":
        return None
    from specd.model.store import read_kept

    path, key = _path(draft_model, target_model)
    try:
        kept = read_kept(path, FORMAT, key)
        return Choice(**kept["choice"]) if kept else None
    except (TypeError, KeyError):
        return None


def forget(draft_model: str, target_model: str) -> bool:
    """Drop the kept choice (back to the rule); whether there was one."""
    path, _ = _path(draft_model, target_model)
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False
