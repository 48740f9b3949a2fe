"""Cost of one batched pass on the real pair, by batch size: where the time goes with B streams.

    .venv/bin/python scripts/measure_batching.py [--batch 1,2,4,8] [--k 4] [--context 30] [--dtype bfloat16]

In process, no gRPC: B sessions with `context` cached tokens each; median time of one
Propose(K) batch on the draft, one Verify(K) batch and one Decode batch on the target.
"""

import argparse
import statistics
import time

import torch

from specd.draft_service.drafter import Drafter, ProposeCall
from specd.model.loading import default_dtype, load_model
from specd.model.sampling import Sampling
from specd.model.sessions import Cursor
from specd.model.transformers_engine import TransformersEngine
from specd.proto.contract import fingerprint
from specd.proto.limits import Limits
from specd.target_service.verifier import Verifier, VerifyCall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1,2,4,8")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--context", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default=None)
    args = parser.parse_args()
    dtype = args.dtype or str(default_dtype()).removeprefix("torch.")
    draft = Drafter(TransformersEngine(load_model("draft", dtype)), Limits())
    target = Verifier(TransformersEngine(load_model("target", dtype)), Limits())
    sizes = [int(size) for size in args.batch.split(",")]
    print(f"{dtype}, K={args.k}, {args.context} cached tokens per session, median of {args.repeats}")
    print(
        f"{'B':>3} {'Propose batch':>14} {'Verify batch':>13} {'Decode batch':>13} {'spec step/B':>12} {'decode/B':>9}"
    )
    for size in sizes:
        propose = timed(draft, size, args, lambda engine, calls: engine.propose_batch(calls), propose_calls)
        verify = timed(target, size, args, lambda engine, calls: engine.verify_batch(calls), verify_calls)
        decode = timed(target, size, args, lambda engine, calls: engine.verify_batch(calls), decode_calls)
        print(
            f"{size:>3} {propose:>12.0f}ms {verify:>11.0f}ms {decode:>11.0f}ms "
            f"{(propose + verify) / size:>10.0f}ms {decode / size:>7.0f}ms",
            flush=True,
        )


def context_tokens(row: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(row)
    return torch.randint(100, 20_000, (length,), generator=generator).tolist()


def timed(engine, size: int, args, run, make_calls) -> float:
    """Median ms of one batched call over `size` fresh sessions (rolled back to the same state each time)."""
    contexts = [context_tokens(row, args.context) for row in range(size)]
    for row, tokens in enumerate(contexts):
        engine.prefill(Cursor(f"b{row}", 0, 0, tokens[:-1]))
    samples = []
    for _ in range(args.repeats + 1):
        started = time.perf_counter()
        results = run(engine, make_calls(contexts, args.k))
        samples.append((time.perf_counter() - started) * 1000)
        assert not any(isinstance(result, Exception) for result in results), results
    for row in range(size):
        engine.release(f"b{row}")
    return statistics.median(samples[1:])


def cursor(row: int, tokens: list[int]) -> Cursor:
    return Cursor(f"b{row}", len(tokens) - 1, fingerprint(tokens[:-1]), tokens[-1:])


def propose_calls(contexts, k):
    return [ProposeCall(cursor(row, tokens), k, Sampling()) for row, tokens in enumerate(contexts)]


def verify_calls(contexts, k):
    return [VerifyCall(cursor(row, tokens), tokens[:k], [], Sampling()) for row, tokens in enumerate(contexts)]


def decode_calls(contexts, k):
    return [VerifyCall(cursor(row, tokens), [], [], Sampling()) for row, tokens in enumerate(contexts)]


if __name__ == "__main__":
    main()
