"""The real Qwen2.5-Coder pair on the transformers engine, in float32: one tokenizer, sensible output,
and greedy speculation over real gRPC that emits exactly the target's own greedy tokens
(docs/architecture.md §1, §3, §6), against HF generate as the independent reference.

The float32 target holds 7 GB (its GGUF unties the output layer), so it never shares a process: the
reference is computed in a process of its own, then the target is served by `specd serve target` in
another; the draft (2.5 GB) is served from this one. The real pair on the llama.cpp engine, and the
orchestrator over it, are tests/test_real_llama_cpp.py's and tests/test_real_orchestrator.py's.
"""

import json
import subprocess
import sys
from types import SimpleNamespace

import grpc
import pytest
import torch
from conftest import real_service_process, requires_gpu, serve_draft_beside, start_services
from transformers import AutoTokenizer

from specd.model.fetch import resolve_model
from specd.model.loaded import tokenizer_fingerprint
from specd.model.loading import load_model
from specd.model.store import ModelNotFetchedError
from specd.model.transformers_engine import TransformersEngine
from specd.proto.contract import fingerprint
from specd.v1 import common_pb2, draft_pb2, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.real

VOCAB_SIZE = 151_936
NEW_TOKENS = 32
PROMPTS = [
    "def fibonacci(n):",
    "import numpy as np\n\ndef softmax(x):",
    "# Write a function that parses an ISO 8601 date string",
]
# HF generate's greedy continuations, in a process of its own (argv: model folder, prompts, tokens).
REFERENCE = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, prompts, new_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
reference = {}
for prompt in prompts:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        output = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                                max_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id)
    reference[prompt] = [ids[0].tolist(), output[0, ids.shape[1]:].tolist()]
print(json.dumps(reference))
"""


@pytest.fixture(scope="module")
def target_tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model("target"))


@pytest.fixture(scope="module")
def greedy_reference() -> dict[str, tuple[list[int], list[int]]]:
    """prompt -> (prompt ids, the target's greedy continuation by plain HF generate): the
    independent reference, computed without any specd code path."""
    run = subprocess.run(
        [sys.executable, "-c", REFERENCE, str(resolve_model("target")), json.dumps(PROMPTS), str(NEW_TOKENS)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return {prompt: (ids, continuation) for prompt, (ids, continuation) in json.loads(run.stdout).items()}


@pytest.fixture(scope="module")
def real_draft():
    return load_model("draft", "float32")


@pytest.fixture(scope="module")
async def real_services(real_draft, greedy_reference, tmp_path_factory):
    """The draft served from this process, the target by `specd serve target` (after the reference's
    process has ended: the two never hold 7 GB each at once)."""
    log = tmp_path_factory.mktemp("real-target") / "target.log"
    async with real_service_process("target", log, "--engine", "transformers") as target:
        async with grpc.aio.insecure_channel(target.address) as channel:
            remote = SimpleNamespace(target_server=None, target=target_pb2_grpc.TargetServiceStub(channel))
            services = await serve_draft_beside(lambda limits: TransformersEngine(real_draft), remote)
            yield services
            await services.close()


def test_draft_and_target_share_one_tokenizer(real_draft, target_tokenizer):
    draft, target = real_draft.tokenizer, target_tokenizer
    assert draft.get_vocab() == target.get_vocab()
    assert draft.all_special_tokens == target.all_special_tokens
    assert draft.all_special_ids == target.all_special_ids
    assert tokenizer_fingerprint(draft) == tokenizer_fingerprint(target)
    text = "def f(x):\n    return {'π': x ** 2}  # ✓ <|im_end|>"
    assert draft.encode(text) == target.encode(text)
    # The output layers (logits per position) have the same rows, padded past len(tokenizer).
    assert real_draft.vocab_size == VOCAB_SIZE
    assert len(target) <= VOCAB_SIZE


def test_target_greedy_continuation_is_code(greedy_reference, target_tokenizer):
    # Greedy is prefix-stable, so the first 24 of the 32 generated tokens are generate(24)'s.
    prompt_ids, continuation = greedy_reference["def fibonacci(n):"]
    assert prompt_ids and len(continuation) >= 24
    text = target_tokenizer.decode(continuation[:24])
    assert text.strip(), "empty continuation"
    assert "return" in text or "if" in text, f"not code: {text!r}"


async def test_services_describe_a_matched_pair(real_services, real_draft, target_tokenizer):
    draft = await real_services.draft.Info(common_pb2.InfoRequest())
    target = await real_services.target.Info(common_pb2.InfoRequest())
    assert (draft.role, target.role) == ("draft", "target")
    assert draft.vocab_size == target.vocab_size == VOCAB_SIZE
    assert draft.tokenizer_fingerprint == target.tokenizer_fingerprint
    assert target.tokenizer_fingerprint == tokenizer_fingerprint(target_tokenizer)
    assert draft.dtype == target.dtype == "float32"
    assert list(draft.eos_token_ids) == list(target.eos_token_ids) == real_draft.eos_token_ids
    assert real_draft.eos_token_ids


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["fibonacci", "softmax", "iso8601"])
async def test_greedy_speculation_over_grpc_emits_the_targets_own_tokens(
    real_services, real_draft, target_tokenizer, greedy_reference, prompt, k
):
    prompt_ids, expected = greedy_reference[prompt]
    eos = set(real_draft.eos_token_ids)  # the target's, test_services_describe_a_matched_pair
    decode = target_tokenizer.decode
    emitted, steps, accepted = await speculate(real_services, f"real-{k}-{prompt[:12]}", prompt_ids, k, eos)
    assert emitted == expected, (
        f"K={k}: speculation diverged from plain greedy at token "
        f"{next((i for i, (a, b) in enumerate(zip(emitted, expected)) if a != b), min(len(emitted), len(expected)))}"
        f"\nspeculative: {decode(emitted)!r}\ngreedy:      {decode(expected)!r}"
    )
    print(f"K={k} {prompt[:20]!r}: {len(emitted)} tokens in {steps} steps, α = {accepted / (steps * k):.2f}")
    # Speculation did something: drafts were accepted, so fewer target passes than tokens.
    assert accepted > 0, f"K={k}: no draft token accepted in {steps} steps"
    assert steps < len(emitted)


@pytest.mark.gpu
@requires_gpu
async def test_on_a_gpu_with_cuda_graphs_greedy_speculation_emits_the_targets_own_tokens():
    """The pair in float32 on CUDA, both services stepping through CUDA graphs: K = 4 gives HF
    generate's greedy tokens on the same GPU, and drafts are accepted (scripts/gpu_check.sh)."""
    try:
        loaded = {role: load_model(role, "float32", device="cuda") for role in ("draft", "target")}
    except ModelNotFetchedError as error:
        pytest.skip(str(error))
    target = loaded["target"]
    services = await start_services(loaded["draft"], target, graphs=True)
    try:
        for prompt in PROMPTS:
            ids = target.tokenizer(prompt, return_tensors="pt").input_ids.to("cuda")
            with torch.inference_mode():
                output = target.model.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0
                )
            expected = output[0, ids.shape[1] :].tolist()
            session = f"gpu-{prompt[:12]}"
            emitted, steps, accepted = await speculate(services, session, ids[0].tolist(), 4, set(target.eos_token_ids))
            assert emitted == expected and accepted > 0 and steps < len(emitted)
    finally:
        await services.close()


async def speculate(services, session: str, prompt_ids: list[int], k: int, eos: set[int]):
    """The guess -> verify -> commit loop of an orchestrator, written out by hand.

    Returns (emitted tokens, steps, accepted draft tokens). Follows the consistency contract:
    each service is told `start` (the committed tokens it still holds, tracked here from its
    replies), their fingerprint, and the committed tokens from there on.
    """
    committed = list(prompt_ids)
    for stub in (services.draft, services.target):
        reply = await stub.Prefill(common_pb2.PrefillRequest(cursor=_cursor(session, committed[:-1], 0)))
        assert reply.cached_tokens == len(committed) - 1
    draft_held = target_held = len(committed) - 1  # leading committed tokens each service holds KV for
    steps = accepted_total = 0
    try:
        while len(committed) - len(prompt_ids) < NEW_TOKENS and not eos & set(committed[len(prompt_ids) :]):
            old = len(committed)
            proposal = await services.draft.Propose(
                draft_pb2.ProposeRequest(cursor=_cursor(session, committed, draft_held), num_draft_tokens=k)
            )
            drafts = list(proposal.draft_tokens)
            assert len(drafts) == k and not proposal.q
            assert proposal.cached_tokens == old + k - 1  # committed + the first K-1 guesses
            draft_holds = (committed + drafts)[: proposal.cached_tokens]

            verdict = await services.target.Verify(
                target_pb2.VerifyRequest(cursor=_cursor(session, committed, target_held), draft_tokens=drafts)
            )
            accepted, emitted = verdict.accepted, list(verdict.emitted_tokens)
            assert 0 <= accepted <= k and len(emitted) == accepted + 1
            assert emitted[:accepted] == drafts[:accepted]
            assert verdict.cached_tokens == old + accepted  # the last emitted token has no KV yet

            committed += emitted
            target_held = verdict.cached_tokens
            draft_held = min(_common_prefix(draft_holds, committed), len(committed) - 1)
            assert draft_held == old + min(accepted, k - 1)
            steps += 1
            accepted_total += accepted
    finally:
        for stub in (services.draft, services.target):
            await stub.Release(common_pb2.ReleaseRequest(session_id=session))
    emitted = committed[len(prompt_ids) :][:NEW_TOKENS]
    first_eos = next((i for i, token in enumerate(emitted) if token in eos), None)
    return (emitted if first_eos is None else emitted[: first_eos + 1]), steps, accepted_total


def _cursor(session: str, committed: list[int], start: int) -> common_pb2.SessionCursor:
    return common_pb2.SessionCursor(
        session_id=session, start=start, fingerprint=fingerprint(committed[:start]), tokens=committed[start:]
    )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
