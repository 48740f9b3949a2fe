"""The target engine: score the committed tail plus K drafts in one pass, keep what it agrees with.

Concurrent calls share that pass (verify_batch); each keeps its own rule, randomness and rollback.
A Decode run (target.proto `steps`) is a chain of such calls, each continuing the last (`follow`).
"""

from dataclasses import dataclass, field, replace

import torch

from specd.model.acceptance import accept_draft
from specd.model.engine import Row
from specd.model.errors import EngineError, InvalidRequest
from specd.model.sampling import Sampling, check_penalties, densify, penalise, probs_from_logits
from specd.model.service import ModelService, check_continuation, check_sampling, open_each, single
from specd.model.sessions import Cursor, Session
from specd.proto.contract import fingerprint


@dataclass(frozen=True)
class VerifyCall:
    cursor: Cursor
    draft_tokens: list[int]  # empty: a plain decode step (speculation off)
    q_rows: list[tuple[torch.Tensor, torch.Tensor]]  # when sampling: (token ids, probs) per draft token
    sampling: Sampling
    return_logprobs: bool = False
    top_logprobs: int = 0  # with return_logprobs: the N most likely tokens at each emitted position too
    prompt_logprobs: bool = False  # with return_logprobs, on a decode from token 0: score cursor.tokens[1:] too
    follow: bool = False  # a Decode run goes on after it: say the fingerprint of what the session then holds

    def following(self, step: "Verification") -> "VerifyCall":
        """The run's next Decode: from where `step` left the session, its last token fed back."""
        cursor = Cursor(self.cursor.session_id, step.cached_tokens, step.fingerprint, step.emitted_tokens[-1:])
        return replace(self, cursor=cursor, prompt_logprobs=False)

    @property
    def new_tokens(self) -> int:
        return len(self.cursor.tokens) + len(self.draft_tokens)

    @property
    def logit_rows(self) -> int:
        """Rows of logits the pass keeps: one per draft token plus the bonus row, or, scoring the
        prompt, one per cursor token (row i scores token i + 1; the last is the decode's)."""
        return len(self.cursor.tokens) if self.prompt_logprobs else len(self.draft_tokens) + 1


@dataclass
class Verification:
    accepted: int  # draft tokens kept
    emitted_tokens: list[int]  # accepted drafts + recovered or bonus token
    logprobs: list[float]  # log p of each emitted token (empty unless asked)
    cached_tokens: int  # session length after the rollback
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)  # per emitted token
    prompt_logprobs: list[float] = field(default_factory=list)  # of cursor.tokens[1:], when asked
    prompt_top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    fingerprint: int = 0  # of the cached tokens, when the call asked (`follow`)
    cached_prompt_tokens: int = 0  # cursor tokens the prefix cache served (the call that opened the session)

    def then(self, step: "Verification") -> "Verification":
        """This run's tokens followed by a later step's (a Decode run: no guesses, nothing accepted)."""
        return replace(
            self,
            emitted_tokens=self.emitted_tokens + step.emitted_tokens,
            logprobs=self.logprobs + step.logprobs,
            top_logprobs=self.top_logprobs + step.top_logprobs,
            cached_tokens=step.cached_tokens,
            fingerprint=step.fingerprint,
        )


class Verifier(ModelService):
    role = "target"

    def verify(self, call: VerifyCall) -> Verification:
        return single(self.verify_batch([call]))

    def verify_batch(self, calls: list[VerifyCall]) -> list[Verification | EngineError]:
        """One forward pass over every call's committed tail + drafts, then each call's rule and rollback."""
        results, ready = open_each(calls, self._open)
        rows = [
            Row(call.cursor.session_id, call.cursor.tokens + call.draft_tokens, call.logit_rows) for _, call, _ in ready
        ]
        logits = self.store.forward(rows) if rows else []
        for (index, call, (session, q)), call_logits in zip(ready, logits):
            results[index] = self._judge(call, session, q, call_logits)
        return results

    def _open(self, call: VerifyCall):
        """Every check, then the session synced to the cursor (checks first: a refusal changes nothing)."""
        check_continuation(call.cursor)
        check_sampling(call.sampling)
        check_penalties(call.sampling, self.engine.description.vocab_size)
        if call.draft_tokens:
            self.check_draft_length(len(call.draft_tokens))
        _check_logprobs(call)
        self.store.check_tokens(call.draft_tokens, "draft tokens")
        q = None if call.sampling.greedy else self._dense_q(call.q_rows, call.draft_tokens)
        return self.store.sync(call.cursor, extra_tokens=len(call.draft_tokens)), q

    def _judge(self, call: VerifyCall, session: Session, q, logits: torch.Tensor) -> Verification:
        """The acceptance rule on the target's rows, then the rollback to what it kept."""
        first_position = call.cursor.start + len(call.cursor.tokens)  # where draft_tokens[0] sits
        prompt_rows, logits = (logits[:-1], logits[-1:]) if call.prompt_logprobs else (None, logits)
        # Row i's penalties count the committed tokens and the guesses before it (sampling.py penalise).
        scores = penalise(logits, call.sampling, session.tokens[:first_position], call.draft_tokens)
        p = scores if call.sampling.greedy else probs_from_logits(scores, call.sampling)
        verdict = accept_draft(call.draft_tokens, p, q, call.sampling, first_position)
        self.store.truncate(session, first_position + verdict.accepted)  # the rollback
        verification = Verification(verdict.accepted, verdict.emitted, [], len(session.tokens))
        if call.cursor.start == 0:
            verification.cached_prompt_tokens = session.reused
        if call.follow:
            verification.fingerprint = fingerprint(session.tokens)
        if call.return_logprobs:  # from the raw logits: vLLM's raw logprobs (target.proto)
            verification.logprobs, verification.top_logprobs = _logprobs(logits, verdict.emitted, call.top_logprobs)
        if prompt_rows is not None:
            scored = call.cursor.tokens[1:]
            verification.prompt_logprobs, verification.prompt_top_logprobs = _logprobs(
                prompt_rows, scored, call.top_logprobs
            )
        return verification

    def _dense_q(self, q_rows, draft_tokens: list[int]) -> torch.Tensor:
        k = len(draft_tokens)
        if len(q_rows) != k:
            raise InvalidRequest(f"sampling needs one q row per draft token: got {len(q_rows)} for K={k}")
        vocab = self.engine.description.vocab_size
        rows = []
        for token_ids, probs in q_rows:
            if token_ids.numel() != probs.numel() or token_ids.numel() == 0:
                raise InvalidRequest("each q row needs as many probabilities as token ids, at least one")
            if int(token_ids.max()) >= vocab or not torch.isfinite(probs).all() or (probs < 0).any():
                raise InvalidRequest("q rows must hold in-vocabulary ids and finite, non-negative probabilities")
            rows.append(densify(token_ids, probs, vocab))
        q = torch.stack(rows) if rows else torch.empty(0, vocab)
        if k and (q[torch.arange(k), torch.tensor(draft_tokens)] <= 0).any():
            raise InvalidRequest("every draft token must have q > 0 in its row: it was sampled from q")
        return q.to(self.engine.description.device)  # checked on the host, where it arrived; used beside p


MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_PROMPT_LOGPROBS_TOKENS = 1024  # scoring a prompt keeps a row of logits per token: 0.6 GB at Qwen2.5's vocabulary


def _check_logprobs(call: VerifyCall) -> None:
    if call.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {call.top_logprobs}")
    if call.prompt_logprobs:
        if call.draft_tokens or call.cursor.start or not call.return_logprobs:
            raise InvalidRequest("prompt_logprobs needs return_logprobs on a Decode whose cursor starts at 0")
        if len(call.cursor.tokens) > MAX_PROMPT_LOGPROBS_TOKENS:
            raise InvalidRequest(
                f"prompt_logprobs takes prompts of at most {MAX_PROMPT_LOGPROBS_TOKENS} tokens, "
                f"got {len(call.cursor.tokens)}"
            )


def _logprobs(logits: torch.Tensor, tokens: list[int], top: int = 0) -> tuple[list[float], list]:
    """log p (temperature 1, raw logits) of tokens[i] under row i, and (top > 0) each row's `top`
    most likely (token ids, log p), most likely first; one copy to the host each."""
    rows = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    chosen = rows[torch.arange(len(tokens), device=rows.device), torch.tensor(tokens, device=rows.device)].tolist()
    if not top:
        return chosen, []
    values, indices = rows.topk(top, dim=-1)
    return chosen, list(zip(indices.tolist(), values.tolist()))
