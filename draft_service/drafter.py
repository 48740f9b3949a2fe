"""The draft engine: sync each session to the committed tokens, then guess K tokens one at a time.

Concurrent calls share each of those passes (propose_batch): one pass of the draft per drafted
position serves every session, each with its own K, sampling and randomness. When sampling, a
call's K q rows must fit in --max-q-bytes (proto/limits.py q_bytes): a call that could pass it is
refused before anything runs.
"""

from dataclasses import dataclass

import torch

from specd.model.engine import Row
from specd.model.errors import EngineError, InvalidRequest
from specd.model.sampling import Sampling, check_penalties, draw, penalise, probs_from_logits, prune_q
from specd.model.service import ModelService, check_continuation, check_sampling, open_each, single
from specd.model.sessions import Cursor
from specd.proto.contract import Stream
from specd.proto.limits import q_bytes, q_draft_tokens, q_row_bytes, q_row_entries, q_top_k


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
    cached_tokens: int  # session length after the call: committed + first K-1 guesses (all, if cut short)
    q_bytes: int = 0  # the most its q rows take on the wire (proto/limits.py q_row_bytes)


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
        check_penalties(call.sampling, self.engine.description.vocab_size)
        self._check_q_bytes(call)
        return self.store.sync(call.cursor, extra_tokens=call.k - 1)

    def _check_q_bytes(self, call: ProposeCall) -> None:
        """Refuse a sampled call whose K q rows, min(top_k, V) entries each at most, could take more
        than --max-q-bytes: before its session is touched, so nothing runs or changes for it."""
        if call.sampling.greedy:
            return
        vocab, limit, top_k = self.engine.description.vocab_size, self.limits.max_q_bytes, call.sampling.top_k
        if q_bytes(call.k, top_k, vocab) > limit:
            raise InvalidRequest(_too_many_q_bytes(call.k, top_k, vocab, limit))

    def _draft(self, calls: list[ProposeCall]) -> list[Proposal]:
        """One pass per guessed position over every session: the first feeds the committed tail,
        each next one the previous guess (but a row's last guess: the next call rolls back anyway)."""
        session_ids = [call.cursor.session_id for call in calls]
        proposals = [Proposal([], [], 0) for _ in calls]
        lengths = [call.k for call in calls]  # a call's K, cut where a row would not fit (_guess)
        feed = [call.cursor.tokens for call in calls]
        with self.store.passes(session_ids):
            for step in range(max(lengths)):
                rows = [Row(session_id, tokens, min(len(tokens), 1)) for session_id, tokens in zip(session_ids, feed)]
                for index, (call, proposal, logits) in enumerate(zip(calls, proposals, self.store.forward(rows))):
                    if step < lengths[index] and not self._guess(call, proposal, logits[-1]):
                        lengths[index] = step
                feed = [[guess.draft_tokens[-1]] if step + 1 < k else [] for k, guess in zip(lengths, proposals)]
                if not any(feed):
                    break
        return proposals

    def _guess(self, call: ProposeCall, proposal: Proposal, logits: torch.Tensor) -> bool:
        """Append the next guess (and, when sampling, the q row it was drawn from). False, adding
        nothing, where that row would take the call's rows past --max-q-bytes: _check_q_bytes counted
        min(top_k, V) entries a row, and logits tied at the k-th largest keep more. The call then
        answers the guesses it has (a smaller K), never a larger reply."""
        committed = call.cursor.start + len(call.cursor.tokens)
        position = committed + len(proposal.draft_tokens)
        if call.sampling.penalised:  # q, like p, penalised over everything before this position
            history = self.store.sessions[call.cursor.session_id].tokens[:committed] + proposal.draft_tokens
            logits = penalise(logits[None], call.sampling, history)[0]
        if call.sampling.greedy:
            proposal.draft_tokens.append(int(logits.argmax()))
            return True
        token_ids, probs = (tensor.cpu() for tensor in prune_q(probs_from_logits(logits, call.sampling)))
        row_bytes = q_row_bytes(len(token_ids), self.engine.description.vocab_size)
        if proposal.q_bytes + row_bytes > self.limits.max_q_bytes:
            return False
        index = draw(probs, call.sampling, position, Stream.DRAFT)
        proposal.draft_tokens.append(int(token_ids[index]))
        proposal.q.append((token_ids, probs))
        proposal.q_bytes += row_bytes
        return True


def _too_many_q_bytes(k: int, top_k: int, vocab_size: int, limit: int) -> str:
    """What a refused call asked for, what its q rows could take, and what would fit."""
    entries = q_row_entries(top_k, vocab_size)
    asked = f"top_k={top_k:,}" + ("" if entries < vocab_size else " (off)" if not top_k else " (the whole vocabulary)")
    fits_k, fits_top_k = q_draft_tokens(limit, top_k, vocab_size), q_top_k(limit, k, vocab_size)
    fixes = ([f"K <= {fits_k}"] if fits_k else []) + ([f"top_k <= {fits_top_k:,}"] if fits_top_k else [])
    return (
        f"sampling K={k} guesses at {asked}: up to {entries:,} entries a q row, {q_bytes(k, top_k, vocab_size):,} "
        f"bytes of q rows, over this draft's limit of {limit:,} bytes (--max-q-bytes); ask for "
        + ", or ".join([*fixes, "raise the draft's --max-q-bytes"])
    )
