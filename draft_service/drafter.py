"""The draft engine: sync each session to the committed tokens, then guess K tokens one at a time.

Concurrent calls share each of those passes (propose_batch): one pass of the draft per drafted
position serves every session, each with its own K, sampling and randomness.
"""

from dataclasses import dataclass

import torch

from specd.model.engine import Row
from specd.model.errors import EngineError
from specd.model.sampling import Sampling, draw, probs_from_logits, prune_q
from specd.model.service import ModelService, check_continuation, check_sampling, open_each, single
from specd.model.sessions import Cursor
from specd.proto.contract import Stream


@dataclass(frozen=True)
class ProposeCall:
    cursor: Cursor
    k: int  # draft tokens to guess
    sampling: Sampling

    @property
    def new_tokens(self) -> int:
        return len(self.cursor.tokens) + self.k


@dataclass
class Proposal:
    draft_tokens: list[int]  # the K guesses
    q: list[tuple[torch.Tensor, torch.Tensor]]  # when sampling: (token ids, probs) per guess
    cached_tokens: int  # session length after the call: committed + first K-1 guesses


class Drafter(ModelService):
    role = "draft"

    def propose(self, call: ProposeCall) -> Proposal:
        return single(self.propose_batch([call]))

    def propose_batch(self, calls: list[ProposeCall]) -> list[Proposal | EngineError]:
        results, ready = open_each(calls, self._open)
        proposals = self._draft([call for _, call, _ in ready]) if ready else []
        for (index, _, session), proposal in zip(ready, proposals):
            proposal.cached_tokens = len(session.tokens)
            results[index] = proposal
        return results

    def _open(self, call: ProposeCall):
        check_continuation(call.cursor)
        self.check_draft_length(call.k)
        check_sampling(call.sampling)
        return self.store.sync(call.cursor, extra_tokens=call.k - 1)

    def _draft(self, calls: list[ProposeCall]) -> list[Proposal]:
        """One pass per guessed position over every session: the first feeds the committed tail,
        each next one the previous guess (but a row's last guess: the next call rolls back anyway)."""
        session_ids = [call.cursor.session_id for call in calls]
        proposals = [Proposal([], [], 0) for _ in calls]
        feed = [call.cursor.tokens for call in calls]
        with self.engine.passes(session_ids):
            for step in range(max(call.k for call in calls)):
                rows = [Row(session_id, tokens, min(len(tokens), 1)) for session_id, tokens in zip(session_ids, feed)]
                for call, proposal, logits in zip(calls, proposals, self.store.forward(rows)):
                    if step < call.k:
                        self._guess(call, proposal, logits[-1])
                feed = [[guess.draft_tokens[-1]] if step + 1 < call.k else [] for call, guess in zip(calls, proposals)]
        return proposals

    @staticmethod
    def _guess(call: ProposeCall, proposal: Proposal, logits: torch.Tensor) -> None:
        """Append the next guess (and, when sampling, the q row it was drawn from)."""
        position = call.cursor.start + len(call.cursor.tokens) + len(proposal.draft_tokens)
        if call.sampling.greedy:
            proposal.draft_tokens.append(int(logits.argmax()))
            return
        token_ids, probs = (tensor.cpu() for tensor in prune_q(probs_from_logits(logits, call.sampling)))
        index = draw(probs, call.sampling, position, Stream.DRAFT)
        proposal.draft_tokens.append(int(token_ids[index]))
        proposal.q.append((token_ids, probs))
