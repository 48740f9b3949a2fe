"""Batching across sessions: one forward pass for many calls gives each exactly its unbatched result."""

import pytest
import torch

from specd.draft_service.drafter import Drafter, ProposeCall
from specd.model.errors import SessionNotFound
from specd.model.sampling import Sampling
from specd.model.sessions import Cursor
from specd.model.transformers_engine import TransformersEngine
from specd.proto.contract import fingerprint
from specd.proto.limits import MAX_Q_BYTES, Limits
from specd.target_service.verifier import Verifier, VerifyCall

PROMPTS = [list(range(1000, 1003)), list(range(2000, 2011)), list(range(3000, 3006)), list(range(4000, 4020))]
SAMPLED = Sampling(temperature=0.9, top_p=0.95, seed=11)


class Conversation:
    """One session's committed tokens, and the cursor that asks for its next step."""

    def __init__(self, session_id: str, prompt: list[int]):
        self.session_id, self.committed, self.held = session_id, list(prompt), len(prompt) - 1

    def cursor(self) -> Cursor:
        return Cursor(self.session_id, self.held, fingerprint(self.committed[: self.held]), self.committed[self.held :])

    def commit(self, emitted: list[int], cached_tokens: int) -> None:
        self.committed += emitted
        self.held = cached_tokens


def greedy_continuation(loaded, prompt: list[int], length: int) -> list[int]:
    output = loaded.model.generate(
        torch.tensor([prompt]), max_new_tokens=length, min_new_tokens=length, do_sample=False
    )
    return output[0, len(prompt) :].tolist()


def q_rows_for(drafts: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A q that gave each draft token 0.5 and spread the rest over three neighbours."""
    return [
        (torch.tensor([token, token + 1, token + 2, token + 3]), torch.tensor([0.5, 0.2, 0.2, 0.1])) for token in drafts
    ]


def opened(engine, tag: str) -> list[Conversation]:
    conversations = [Conversation(f"{tag}-{i}", prompt) for i, prompt in enumerate(PROMPTS)]
    for conversation in conversations:
        engine.prefill(Cursor(conversation.session_id, 0, 0, conversation.committed[:-1]))
    return conversations


def verify_calls(conversations, step: int, references, ks=(1, 3, 5, 4)) -> list[VerifyCall]:
    """Mixed K (0: a plain decode row), each draft corrupted at a different place (different
    accepted counts), one row sampled."""
    calls = []
    for i, conversation in enumerate(conversations):
        k = ks[i]
        done = len(conversation.committed) - len(PROMPTS[i])
        drafts = references[i][done : done + k]
        wrong_at = (i + step) % (k + 1)  # k + 1: no corruption, all accepted
        if wrong_at < k:
            drafts = drafts[:wrong_at] + [(drafts[wrong_at] + 7) % 150_000] + drafts[wrong_at + 1 :]
        sampling = SAMPLED if i == 2 else Sampling()
        calls.append(VerifyCall(conversation.cursor(), drafts, q_rows_for(drafts) if i == 2 else [], sampling, True))
    return calls


@pytest.mark.parametrize("ks", [(1, 3, 5, 4), (0, 3, 0, 4)], ids=["verify", "verify-and-decode"])
def test_verify_batch_equals_one_call_at_a_time(tiny_loaded, ks):
    """Verify rows, and verify rows of speculative sessions beside decode rows of target-only ones
    (one pass for every ready session): the same tokens, accepted counts and caches as alone."""
    engine = Verifier(TransformersEngine(tiny_loaded["target"]), Limits())
    references = [greedy_continuation(tiny_loaded["target"], prompt, 40) for prompt in PROMPTS]
    alone, together = opened(engine, "alone"), opened(engine, "together")
    accepted_counts = set()
    for step in range(6):
        solo = [engine.verify(call) for call in verify_calls(alone, step, references, ks)]
        batched = engine.verify_batch(verify_calls(together, step, references, ks))
        for a, b, conversation_a, conversation_b in zip(solo, batched, alone, together):
            assert (b.accepted, b.emitted_tokens, b.cached_tokens) == (a.accepted, a.emitted_tokens, a.cached_tokens)
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
            conversation_a.commit(a.emitted_tokens, a.cached_tokens)
            conversation_b.commit(b.emitted_tokens, b.cached_tokens)
            accepted_counts.add(a.accepted)
    assert len(accepted_counts) >= 4, "the schedule should give different accepted counts in one pass"
    for a, b in zip(alone, together):  # the caches written back are the sessions' own
        assert engine.store.sessions[b.session_id].tokens == engine.store.sessions[a.session_id].tokens


def test_decode_steps_batch_too(tiny_loaded):
    engine = Verifier(TransformersEngine(tiny_loaded["target"]), Limits())
    alone, together = opened(engine, "alone"), opened(engine, "together")
    for _ in range(5):
        solo = [engine.verify(VerifyCall(c.cursor(), [], [], Sampling())) for c in alone]
        batched = engine.verify_batch([VerifyCall(c.cursor(), [], [], Sampling()) for c in together])
        assert [b.emitted_tokens for b in batched] == [a.emitted_tokens for a in solo]
        for a, b, ca, cb in zip(solo, batched, alone, together):
            ca.commit(a.emitted_tokens, a.cached_tokens)
            cb.commit(b.emitted_tokens, b.cached_tokens)
    assert [c.committed for c in together] == [c.committed for c in alone]


def test_a_refused_call_leaves_its_batch_alone(tiny_loaded):
    engine = Verifier(TransformersEngine(tiny_loaded["target"]), Limits())
    alone, together = opened(engine, "alone"), opened(engine, "together")
    engine.release(together[1].session_id)  # released while its call waited
    stale = together[3].cursor()
    stale = Cursor(stale.session_id, stale.start, stale.fingerprint + 1, stale.tokens)  # wrong fingerprint
    calls = [VerifyCall(c.cursor(), [5, 6], [], Sampling()) for c in together]
    calls[3] = VerifyCall(stale, [5, 6], [], Sampling())
    results = engine.verify_batch(calls)
    assert isinstance(results[1], SessionNotFound)
    assert type(results[3]).__name__ == "CursorMismatch"
    for index in (0, 2):
        expected = engine.verify(VerifyCall(alone[index].cursor(), [5, 6], [], Sampling()))
        assert results[index].emitted_tokens == expected.emitted_tokens
    assert len(engine.store.sessions[together[3].session_id].tokens) == len(PROMPTS[3]) - 1  # untouched


@pytest.mark.parametrize("sampling", [Sampling(), SAMPLED], ids=["greedy", "sampled"])
def test_propose_batch_equals_one_call_at_a_time(tiny_loaded, sampling):
    # K up to 5 of nearly dense q rows (a tiny random model's): 5.2 MB, past the default cap
    engine = Drafter(TransformersEngine(tiny_loaded["draft"]), Limits(max_q_bytes=MAX_Q_BYTES))
    alone, together = opened(engine, "alone"), opened(engine, "together")
    for step in range(4):
        ks = [(i + step) % 5 + 1 for i in range(len(PROMPTS))]
        solo = [engine.propose(ProposeCall(c.cursor(), k, sampling)) for c, k in zip(alone, ks)]
        batched = engine.propose_batch([ProposeCall(c.cursor(), k, sampling) for c, k in zip(together, ks)])
        for a, b, ca, cb, k in zip(solo, batched, alone, together, ks):
            assert (b.draft_tokens, b.cached_tokens) == (a.draft_tokens, a.cached_tokens)
            assert len(b.draft_tokens) == k
            for (ids_a, probs_a), (ids_b, probs_b) in zip(a.q, b.q):
                assert torch.equal(ids_a, ids_b) and torch.allclose(probs_a, probs_b, atol=1e-6)
            keep = a.draft_tokens[: step % (k + 1)] + [17]  # commit a few guesses and a correction
            ca.commit(keep, len(ca.committed))
            cb.commit(keep, len(cb.committed))


# -- the scheduler, on plain functions --------------------------------------------------------
