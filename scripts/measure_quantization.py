#!/usr/bin/env python
"""Draft quantization schemes side by side: time per drafted token and agreement with the target.

For each bench prompt the target (bf16, greedy) writes --tokens tokens once; then each draft
variant (none = bf16, int8 and int4 weight-only via torchao) is
  - teacher-forced over prompt + those tokens: agreement = share of positions where the
    draft's greedy guess equals the target's token (the greedy acceptance rate α at K = 1);
  - timed on one-token steps after the prompt (the draft's work in a Propose), interleaved
    variant by variant per prompt so machine drift falls on all alike.
c = draft time per token / target time per token (the target's, measured the same way).

Usage: .venv/bin/python scripts/measure_quantization.py [--prompts 12] [--tokens 32] [--json OUT]
"""

import argparse
import json
import statistics
import time

import torch
from tqdm import tqdm

from specd.bench.loadtest import DEFAULT_PROMPTS
from specd.bench.systems import load_prompts
from specd.model.loading import load_model

SCHEMES = ("none", "int8", "int4")


def continuation(target, prompt_ids: torch.Tensor, tokens: int) -> torch.Tensor:
    with torch.inference_mode():
        return target.model.generate(
            prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            do_sample=False,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
        )[0]


def agreement(model, sequence: torch.Tensor, prompt_length: int) -> tuple[int, int]:
    """(positions where the model's greedy guess is the target's token, positions)."""
    with torch.inference_mode():
        guesses = model(sequence[None]).logits[0, prompt_length - 1 : -1].argmax(-1)
    truth = sequence[prompt_length:]
    return int((guesses == truth).sum()), truth.numel()


def step_seconds(model, sequence: torch.Tensor, prompt_length: int, steps: int) -> list[float]:
    """Seconds of each one-token forward after the prompt is cached."""
    from transformers import DynamicCache

    cache, times = DynamicCache(), []
    with torch.inference_mode():
        model(sequence[None, :prompt_length], past_key_values=cache, use_cache=True)
        for position in range(prompt_length, min(len(sequence), prompt_length + steps)):
            started = time.perf_counter()
            model(sequence[None, position : position + 1], past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=12, help="the first N bench prompts")
    parser.add_argument("--tokens", type=int, default=32, help="target tokens per prompt")
    parser.add_argument("--steps", type=int, default=8, help="timed one-token steps per prompt and model")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    prompts = load_prompts(DEFAULT_PROMPTS)[0][: args.prompts]
    target = load_model("target", "bfloat16")
    drafts = {scheme: load_model("draft", "bfloat16", quantization=scheme).model for scheme in SCHEMES}
    sequences = []
    for prompt in tqdm(prompts, desc="target continuations"):
        ids = torch.tensor([target.tokenizer(prompt, add_special_tokens=False).input_ids])
        sequences.append((ids.shape[1], continuation(target, ids, args.tokens)))
    agreed = {scheme: [0, 0] for scheme in SCHEMES}
    times = {scheme: [] for scheme in (*SCHEMES, "target")}
    for prompt_length, sequence in tqdm(sequences, desc="drafts (interleaved)"):
        for scheme, model in drafts.items():
            hits, total = agreement(model, sequence, prompt_length)
            agreed[scheme][0] += hits
            agreed[scheme][1] += total
            times[scheme] += step_seconds(model, sequence, prompt_length, args.steps)
        times["target"] += step_seconds(target.model, sequence, prompt_length, args.steps)
    target_step = statistics.median(times["target"])
    report = {
        "settings": {
            "prompts": len(prompts),
            "tokens": args.tokens,
            "steps": args.steps,
            "dtype": "bfloat16",
            "threads": torch.get_num_threads(),
        },
        "target_seconds_per_token": target_step,
        "schemes": {
            scheme: {
                "agreement": agreed[scheme][0] / agreed[scheme][1],
                "seconds_per_token": statistics.median(times[scheme]),
                "seconds_per_token_p25": statistics.quantiles(times[scheme], n=4)[0],
                "c": statistics.median(times[scheme]) / target_step,
            }
            for scheme in SCHEMES
        },
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
            out.write("\n")


if __name__ == "__main__":
    main()
