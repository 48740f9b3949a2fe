"""Sampling is exact through the whole distributed path: seeded speculative generations, sent through
the orchestrator (Ray) to a draft process and a target service over gRPC, follow the target's own
distribution at every position, with the draft killed (SIGKILL) and restarted mid-run so that part of
them runs target-only (fail closed); and the same test rejects speculation with a wrong
acceptance rule (every guess kept), so it has the power to see one.

The test: each output token x at a position maps to u = P(p(Y) > p(x)) + V·P(p(Y) = p(x)), Y drawn
from the target's row p after the same prefix and V uniform (a fixed generator): the randomized
probability integral transform. Under exact sampling every u is uniform on [0, 1) and independent of
the others, whatever the prefix, so all positions of all generations pool into one Pearson
chi-square over equal bins of u; a token the target can never emit there (outside top-k or top-p)
fails the test outright. The rows p come from the tiny target itself, one full forward per
generation here in the test (no cache, no batching, no services).

The pair is tiny and made for counting: 512 ids, untied output embeddings (a tied one makes the last
token dominate every row), and the final norm scaled so that at temperature 1 a few tens of ids hold
nearly all the mass. The draft is the target plus noise (α about 0.25): often rejected, often
accepted.
"""

import asyncio
import copy
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch
from conftest import TINY_CONFIG, TOKENIZER
from test_faults import DraftProcess
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from specd.model import acceptance
from specd.model.fetch import resolve_tokenizer
from specd.model.loading import load_model
from specd.model.sampling import Sampling, probs_from_logits, sample
from specd.model.transformers_engine import TransformersEngine
from specd.orchestrator.faults import FaultPolicy
from specd.orchestrator.server import OrchestratorServer
from specd.proto.contract import Stream, position_uniform
from specd.proto.limits import Limits
from specd.target_service.server import create_target_server
from specd.target_service.verifier import Verifier
from specd.v1 import common_pb2, specdecode_pb2, specdecode_pb2_grpc

RESULTS = Path(__file__).parent.parent / "docs" / "results" / "chi_square_grpc.json"
VOCAB = 512
LOGIT_SCALE = 20.0  # the final norm's weight times this: a few tens of ids per row at temperature 1
DRAFT_NOISE = 0.006  # per weight (the weights' own scale is 0.02): α about 0.25
PROMPT = [35, 8, 17, 50, 3, 41, 22, 9]  # token ids, all below VOCAB
NEW_TOKENS = 16
K = 3
VARIANTS = {  # name -> SamplingParams fields; generation i takes the (i mod 3)-th
    "temperature 1": dict(temperature=1.0),
    "top_k 6": dict(temperature=1.0, top_k=6),
    "top_p 0.8": dict(temperature=1.0, top_p=0.8),
}
GENERATIONS = 96  # x NEW_TOKENS = 1,536 tokens a run, 512 per variant
CONCURRENCY = 16
BINS = 20
THRESHOLD = 1e-3  # exact sampling fails it once in a thousand runs; the wrong rule's p-value is far below
POLICY = FaultPolicy(propose_timeout_s=3.0, call_timeout_s=30.0, target_retry_s=10.0, draft_backoff_s=(0.2, 1.0))


def make_pair(root: Path) -> dict[str, Path]:
    """The tiny target and its noisy draft, saved as Hugging Face folders: role -> folder."""
    torch.manual_seed(5)
    target = Qwen2ForCausalLM(Qwen2Config(**{**TINY_CONFIG, "vocab_size": VOCAB, "tie_word_embeddings": False}))
    with torch.no_grad():
        target.model.norm.weight.mul_(LOGIT_SCALE)
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for parameter in draft.parameters():
            scale = LOGIT_SCALE if parameter is draft.model.norm.weight else 1.0
            parameter.add_(torch.randn_like(parameter) * DRAFT_NOISE * scale)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER or resolve_tokenizer("draft"))  # the services describe it
    for role, model in (("draft", draft), ("target", target)):
        model.save_pretrained(root / role)
        tokenizer.save_pretrained(root / role)
    return {role: root / role for role in ("draft", "target")}


class FloatDraft(DraftProcess):
    """`specd serve draft` in float32, unquantized: the draft as built, so its q is the one the power of
    the negative control was sized for (`--quantize auto` would make a CPU draft int4)."""

    def spawn(self) -> None:
        command = [sys.executable, "-m", "specd.cli", "serve", "draft", "--model", str(self.model_dir)]
        command += ["--dtype", "float32", "--quantize", "none", "--threads", "1", "--port", str(self.port)]
        self.process = subprocess.Popen(
            [*command, "--no-metrics"],
            stdout=open(self.log_path, "a"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


@dataclass
class Stack:
    draft: DraftProcess  # `specd serve draft`, a process of its own: killing it is a real crash
    client: specdecode_pb2_grpc.SpecDecodeStub  # the orchestrator's
    target_model: torch.nn.Module  # the target service's model, for the exact rows


@pytest.fixture(scope="module")
async def stack(ray_local, tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling_grpc")
    folders = make_pair(root)
    draft = FloatDraft(folders["draft"], root / "draft.log")
    draft.spawn()
    loaded = load_model(str(folders["target"]), "float32")
    target = create_target_server(lambda: Verifier(TransformersEngine(loaded), Limits()))
    await target.start("127.0.0.1:0")
    await target.load()
    orchestrator = channel = None
    try:
        await draft.serving()
        orchestrator = OrchestratorServer(draft.address, f"127.0.0.1:{target.port}", workers=2, policy=POLICY)
        await orchestrator.start("127.0.0.1:0")
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}")
        yield Stack(draft, specdecode_pb2_grpc.SpecDecodeStub(channel), loaded.model)
    finally:
        if channel:
            await channel.close()
        if orchestrator:
            await orchestrator.stop(0)
        await target.stop(0)
        draft.kill()


# -- generating ---------------------------------------------------------------------------------


@dataclass
class Output:
    variant: str
    tokens: list[int] = field(default_factory=list)
    steps: list[tuple[int, int]] = field(default_factory=list)  # per step: (K, tokens emitted)
    resyncs: int = 0
    accepted: int = 0  # draft tokens the target kept

    @property
    def fail_closed_steps(self) -> int:
        """Steps that ran target-only although K > 0 and more than one token was left: the draft was down."""
        left, skipped = NEW_TOKENS, 0
        for index, (k, emitted) in enumerate(self.steps):
            skipped += index > 0 and k == 0 and left > 1
            left -= emitted
        return skipped


def generation_request(seed: int) -> tuple[str, specdecode_pb2.GenerateRequest]:
    name = list(VARIANTS)[seed % len(VARIANTS)]
    message = specdecode_pb2.GenerateRequest(
        prompt_token_ids=PROMPT,
        max_new_tokens=NEW_TOKENS,
        sampling=common_pb2.SamplingParams(**VARIANTS[name], seed=seed),
        ignore_eos=True,
        draft_tokens=K,
        drafter="model",  # no prompt lookup: every guess is the draft service's
    )
    return name, message


async def generate_all(client, before_each=None) -> list[Output]:
    """Seeds 0..GENERATIONS-1, CONCURRENCY at a time, in seed order; `before_each(seed)` is awaited
    before each is sent."""
    outputs: list[Output | None] = [None] * GENERATIONS
    seeds = iter(range(GENERATIONS))

    async def one_at_a_time():
        for seed in seeds:
            if before_each:
                await before_each(seed)
            name, message = generation_request(seed)
            output, emitted = Output(name), []  # emitted: each step's tokens (one Delta per step)
            async for reply in client.Generate(message, timeout=120):
                if reply.HasField("final"):
                    output.steps = list(zip(reply.final.stats.draft_lengths, emitted))
                    output.resyncs = reply.final.stats.resyncs
                    output.accepted = reply.final.stats.accepted
                else:
                    output.tokens += reply.delta.token_ids
                    emitted.append(len(reply.delta.token_ids))
            outputs[seed] = output

    await asyncio.gather(*(one_at_a_time() for _ in range(CONCURRENCY)))
    return outputs


# -- the test -----------------------------------------------------------------------------------


def sampling_of(name: str) -> Sampling:
    fields = VARIANTS[name]
    return Sampling(fields["temperature"], top_p=fields.get("top_p", 1.0), top_k=fields.get("top_k", 0))


def target_rows(model, output: Output) -> torch.Tensor:
    """[NEW_TOKENS, V] float64: the target's row at each output position, from one full forward."""
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + output.tokens[:-1]])).logits[0, len(PROMPT) - 1 :]
    return probs_from_logits(logits, sampling_of(output.variant)).double()


def transformed(outputs: list[Output], model) -> list[tuple[str, list[float]]]:
    """Per output: its variant and the u of each of its tokens (None for a token the target cannot emit)."""
    uniform = torch.Generator().manual_seed(0)
    result = []
    for output in outputs:
        rows = target_rows(model, output)
        us = []
        for row, token in zip(rows, output.tokens):
            p = row[token]
            v = float(torch.rand((), generator=uniform, dtype=torch.float64))
            us.append(float(row[row > p].sum() + v * row[row == p].sum()) if p > 0 else None)
        result.append((output.variant, us))
    return result


def chi_square(us: list[float | None]) -> dict:
    """Pearson's chi-square of the u values against uniform, over BINS equal bins."""
    impossible = sum(u is None for u in us)
    counts = torch.zeros(BINS, dtype=torch.float64)
    for u in us:
        if u is not None:
            counts[min(int(u * BINS), BINS - 1)] += 1
    expected = counts.sum() / BINS
    statistic = float(((counts - expected) ** 2 / expected).sum())
    df = BINS - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(statistic / 2)))
    return dict(
        p_value=0.0 if impossible else p_value,
        p_value_in_support=p_value,  # the chi-square alone, over the tokens the target can emit
        statistic=statistic,
        df=df,
        tokens=len(us),
        impossible=impossible,
    )


def report(outputs: list[Output], model, label: str) -> dict:
    """The test over all outputs, and over each variant's alone; printed and returned."""
    values = transformed(outputs, model)
    results = {"all": chi_square([u for _, us in values for u in us])}
    for name in VARIANTS:
        results[name] = chi_square([u for variant, us in values if variant == name for u in us])
    for name, result in results.items():
        print(
            f"{label}, {name}: p = {result['p_value']:.3g}, in support {result['p_value_in_support']:.3g} "
            f"(chi-square {result['statistic']:.1f}, "
            f"df {result['df']}, {result['tokens']} tokens, {result['impossible']} impossible)"
        )
    return results


def speculation(outputs: list[Output]) -> dict:
    """How the run went: steps that drafted, steps that failed closed (and in how many generations),
    α, and resyncs."""
    drafted = sum(k for output in outputs for k, _ in output.steps)
    return dict(
        drafting_steps=sum(k > 0 for output in outputs for k, _ in output.steps),
        fail_closed_steps=sum(output.fail_closed_steps for output in outputs),
        generations_with_fail_closed_steps=sum(output.fail_closed_steps > 0 for output in outputs),
        acceptance_rate=round(sum(output.accepted for output in outputs) / max(1, drafted), 3),
        resyncs=sum(output.resyncs for output in outputs),
    )


def save(key: str, value: dict) -> None:
    """Print `value`; with SPECD_WRITE_RESULTS=1 merge it into docs/results/chi_square_grpc.json under `key`."""
    print(key, json.dumps(value, indent=2))
    if not os.environ.get("SPECD_WRITE_RESULTS"):
        return
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    results[key] = value
    results["setup"] = dict(
        vocabulary=VOCAB,
        new_tokens=NEW_TOKENS,
        draft_tokens=K,
        generations=GENERATIONS,
        variants=VARIANTS,
        bins=BINS,
        threshold=THRESHOLD,
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


async def test_speculative_sampling_follows_the_target_through_a_draft_kill_and_restart(stack):
    """A quarter of the way in the draft is killed and restarted at once; generations go on meanwhile
    (target-only while it is down), and the second half waits until it serves again."""
    kill_at, back_at = GENERATIONS // 4, GENERATIONS // 2
    restarted = []

    async def fault(seed):
        if seed == kill_at:
            stack.draft.kill()  # SIGKILL: its sessions die with it
            stack.draft.spawn()
            restarted.append(asyncio.create_task(stack.draft.serving()))
        if seed >= back_at:
            await restarted[0]

    started = time.monotonic()
    outputs = await generate_all(stack.client, fault)
    run = dict(seconds=round(time.monotonic() - started, 1), **speculation(outputs))
    print(f"{GENERATIONS} generations: {run}")
    results = report(outputs, stack.target_model, "speculative, draft killed and restarted")
    save("exact", dict(run=run, p_values=results))
    assert all(len(output.tokens) == NEW_TOKENS for output in outputs)
    for name, result in results.items():
        assert result["p_value"] > THRESHOLD, (name, result)
    assert run["generations_with_fail_closed_steps"] >= GENERATIONS // 8, "a good share ran while the draft was down"
    assert 0.1 < run["acceptance_rate"] < 0.8, "guesses were both kept and rejected: both branches of the rule ran"
    after = outputs[back_at:]
    assert sum(output.fail_closed_steps == 0 for output in after) > len(after) // 2, "speculation resumed"


def accept_every_guess(draft_tokens, p, q, sampling: Sampling, first_position: int) -> acceptance.Verdict:
    """A wrong rule: keep every guess whatever p says, then the bonus from p; the guessed positions then
    follow the draft's q, not the target's p."""
    u = position_uniform(sampling.seed, first_position + len(draft_tokens), Stream.TARGET)
    return acceptance.Verdict(len(draft_tokens), list(draft_tokens) + [sample(p[-1], u)])


async def test_the_same_test_rejects_a_wrong_acceptance_rule(stack, monkeypatch):
    """The target service (in this process) runs the wrong rule; the same seeds and count, the draft up."""
    await stack.draft.serving()
    monkeypatch.setattr(acceptance, "_accept_sampled", accept_every_guess)
    outputs = await generate_all(stack.client)
    run = speculation(outputs)
    print(f"{GENERATIONS} generations: {run}")
    results = report(outputs, stack.target_model, "wrong rule (accept every guess)")
    save("wrong_rule_accept_every_guess", dict(run=run, p_values=results))
    assert run["fail_closed_steps"] < GENERATIONS // 10, "the draft guessed nearly every step"
    assert results["all"]["p_value"] < THRESHOLD, results["all"]
    # Not only by tokens outside top-k / top-p: at temperature 1 every id is possible, and the chi-square
    # itself rejects; with top-k / top-p it rejects on the tokens inside the support too, more weakly.
    assert results["temperature 1"]["p_value_in_support"] < THRESHOLD, results["temperature 1"]
