#!/usr/bin/env python
"""Latency of one service call on the real pair, over gRPC on loopback and called directly.

Starts the draft and target services in this process (ports 0), opens a session of
--context tokens on each, then times (median of --repeats, after a warm-up):
  Propose(K)   the draft's K guesses (K one-token forward passes)
  Verify(K)    the target scoring the last committed token + K drafts in one pass
  Decode       one plain target step
each rolled back to the same cached prefix every time, so every repeat does the same work;
and the gRPC cost of a call that does no model work (Info, Release of an unknown session).
"overhead" = over-gRPC median − direct engine call median (gRPC on loopback, protobuf,
the hop to the model thread).

Usage: .venv/bin/python scripts/measure_calls.py [--dtype bfloat16|float32] [--repeats 10]
"""

import argparse
import asyncio
import os
import statistics
import time

import grpc
import torch

from specd.draft_service.drafter import Drafter, ProposeCall
from specd.draft_service.server import create_draft_server
from specd.model.loading import default_dtype, load_model
from specd.model.sampling import Sampling
from specd.model.scheduler import Scheduler
from specd.model.sessions import Cursor
from specd.model.transformers_engine import TransformersEngine
from specd.proto.contract import fingerprint
from specd.proto.limits import Limits
from specd.serving.messages import model_info
from specd.target_service.server import create_target_server
from specd.target_service.verifier import Verifier, VerifyCall
from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

# Plain code, long enough to give --context tokens of realistic text.
SOURCE = '''import numpy as np


def softmax(x, axis=-1):
    """Numerically stable softmax along `axis`."""
    shifted = x - np.max(x, axis=axis, keepdims=True)
    exps = np.exp(shifted)
    return exps / np.sum(exps, axis=axis, keepdims=True)


def cross_entropy(logits, labels):
    """Mean cross-entropy of integer `labels` under `logits` of shape [N, C]."""
    probs = softmax(logits)
    picked = probs[np.arange(len(labels)), labels]
    return -np.mean(np.log(picked + 1e-12))


class LinearClassifier:
    def __init__(self, features, classes, seed=0):
        rng = np.random.default_rng(seed)
        self.weights = rng.normal(scale=0.01, size=(features, classes))
        self.bias = np.zeros(classes)

    def logits(self, x):
        return x @ self.weights + self.bias

    def fit(self, x, y, epochs=100, lr=0.1):
        for epoch in range(epochs):
            probs = softmax(self.logits(x))
            probs[np.arange(len(y)), y] -= 1
            grad = probs / len(y)
            self.weights -= lr * x.T @ grad
            self.bias -= lr * grad.sum(axis=0)
            if epoch % 10 == 0:
                print(epoch, cross_entropy(self.logits(x), y))
        return self

    def predict(self, x):
        return np.argmax(self.logits(x), axis=-1)


def accuracy(model, x, y):
    return float(np.mean(model.predict(x) == y))


if __name__ == "__main__":
    rng = np.random.default_rng(1)
'''


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


async def time_pair(over_grpc, direct, repeats: int, warmup: int = 2) -> tuple[list[float], list[float]]:
    """Alternate one call over gRPC and one direct engine call, so a busy machine slows both alike."""
    for _ in range(warmup):
        await over_grpc()
        direct()
    grpc_samples, direct_samples = [], []
    for _ in range(repeats):
        began = time.perf_counter()
        await over_grpc()
        grpc_samples.append(time.perf_counter() - began)
        began = time.perf_counter()
        direct()
        direct_samples.append(time.perf_counter() - began)
    return grpc_samples, direct_samples


async def measure(args) -> None:
    began = time.perf_counter()
    draft_loaded = load_model(args.draft, args.dtype, args.threads)
    target_loaded = load_model(args.target, args.dtype, args.threads)
    print(
        f"loaded draft and target ({args.dtype}, {torch.get_num_threads()} threads) "
        f"in {time.perf_counter() - began:.1f} s"
    )
    if args.dtype == "bfloat16" and default_dtype() != "bfloat16":
        print(
            "note: this CPU has no native bf16 (avx512_bf16/amx_bf16): bf16 matmuls are emulated and "
            "cost grows with the tokens per pass; specd picks float32 by default here"
        )
    load_before = os.getloadavg()[0]
    limits = Limits()
    engines = {}

    def make(role, engine_class, loaded):
        def load():
            engines[role] = engine_class(TransformersEngine(loaded), limits)
            return engines[role]

        return load

    servers = [
        create_draft_server(make("draft", Drafter, draft_loaded)),
        create_target_server(make("target", Verifier, target_loaded)),
    ]
    for server in servers:
        await server.start("127.0.0.1:0")
        await server.load()
    draft_channel = grpc.aio.insecure_channel(f"127.0.0.1:{servers[0].port}")
    target_channel = grpc.aio.insecure_channel(f"127.0.0.1:{servers[1].port}")
    draft = draft_pb2_grpc.DraftServiceStub(draft_channel)
    target = target_pb2_grpc.TargetServiceStub(target_channel)
    draft_engine, target_engine = engines["draft"], engines["target"]

    ids = target_loaded.tokenizer(SOURCE).input_ids
    assert len(ids) > args.context, f"the sample text has only {len(ids)} tokens"
    committed = ids[: args.context + 1]  # the last one is the token each call sends
    held = args.context

    def proto_cursor(session):
        return common_pb2.SessionCursor(
            session_id=session, start=held, fingerprint=fingerprint(committed[:held]), tokens=committed[held:]
        )

    def engine_cursor(session):
        return Cursor(session, held, fingerprint(committed[:held]), committed[held:])

    def opening(session):
        return common_pb2.PrefillRequest(
            cursor=common_pb2.SessionCursor(session_id=session, start=0, fingerprint=0, tokens=committed[:held])
        )

    for session in ("grpc", "direct"):
        await draft.Prefill(opening(session))
        await target.Prefill(opening(session))

    k, greedy = args.k, Sampling()
    drafts = list(
        (await draft.Propose(draft_pb2.ProposeRequest(cursor=proto_cursor("grpc"), num_draft_tokens=k))).draft_tokens
    )
    rows = []  # (what, over gRPC samples, direct samples)

    propose = draft_pb2.ProposeRequest(cursor=proto_cursor("grpc"), num_draft_tokens=k)
    rows.append(
        (
            f"Propose(K={k})",
            *await time_pair(
                lambda: draft.Propose(propose),
                lambda: draft_engine.propose(ProposeCall(engine_cursor("direct"), k, greedy)),
                args.repeats,
            ),
        )
    )
    verify = target_pb2.VerifyRequest(cursor=proto_cursor("grpc"), draft_tokens=drafts)
    rows.append(
        (
            f"Verify(K={k})",
            *await time_pair(
                lambda: target.Verify(verify),
                lambda: target_engine.verify(VerifyCall(engine_cursor("direct"), drafts, [], greedy)),
                args.repeats,
            ),
        )
    )
    decode = target_pb2.DecodeRequest(cursor=proto_cursor("grpc"))
    rows.append(
        (
            "Decode (1 token)",
            *await time_pair(
                lambda: target.Decode(decode),
                lambda: target_engine.verify(VerifyCall(engine_cursor("direct"), [], [], greedy)),
                args.repeats,
            ),
        )
    )
    many = args.repeats * 20  # cheap calls: more samples for a steadier median
    info, scheduler = common_pb2.InfoRequest(), Scheduler()
    rows.append(
        (
            "Info (no model work)",
            *await time_pair(lambda: target.Info(info), lambda: model_info(target_engine, scheduler), many, warmup=20),
        )
    )
    release = common_pb2.ReleaseRequest(session_id="nobody")
    rows.append(
        (
            "Release, unknown session",
            *await time_pair(lambda: target.Release(release), lambda: target_engine.release("nobody"), many, warmup=20),
        )
    )

    print(
        f"\nmedian latency, {args.context} tokens cached, greedy, {args.repeats} repeats "
        f"({many} for the cheap calls); gRPC on loopback, client in the same process; "
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after on {os.cpu_count()} cores"
    )
    print(f"{'call':<26}{'gRPC ms':>10}{'direct ms':>11}{'overhead ms':>13}{'gRPC min..max':>17}")
    for what, over_grpc, direct in rows:
        print(
            f"{what:<26}{median_ms(over_grpc):>10.2f}{median_ms(direct):>11.3f}"
            f"{median_ms(over_grpc) - median_ms(direct):>13.2f}"
            f"{min(over_grpc) * 1e3:>8.1f}..{max(over_grpc) * 1e3:<7.1f}"
        )
    t_propose, t_verify, t_decode = (median_ms(rows[i][1]) for i in range(3))
    print(
        f"\nper target step: Propose(K={k}) + Verify(K={k}) = {t_propose + t_verify:.0f} ms vs Decode "
        f"{t_decode:.0f} ms; Verify(K={k}) / Decode = {t_verify / t_decode:.2f}; "
        f"c = draft token / target step ≈ {t_propose / k / t_decode:.2f}"
    )
    print(
        f"break-even: a step of K={k} must emit ≥ {(t_propose + t_verify) / t_decode:.2f} tokens "
        f"(at most {k + 1}) to beat plain decoding"
    )

    await draft_channel.close()
    await target_channel.close()
    for server in servers:
        await server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--context", type=int, default=200, help="tokens cached before each timed call")
    parser.add_argument("-k", type=int, default=4, help="draft length K")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--draft", default="draft")
    parser.add_argument("--target", default="target")
    asyncio.run(measure(parser.parse_args()))


if __name__ == "__main__":
    main()
