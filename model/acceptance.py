"""The acceptance rule of speculative decoding, as one pure function.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding"),
Chen et al. 2023 ("Accelerating LLM Decoding with Speculative Sampling").

Glossary (docs/architecture.md §2): p = target distribution, q = draft distribution.
- accepted: the prefix of the draft tokens the target agrees with.
- recovered: the target's token at the first rejection (greedy: argmax p; sampling: a draw
  from norm(max(0, p - q))).
- bonus: the target's token after all K draft tokens were accepted (a draw from p[K]).
- emitted = accepted draft tokens + one recovered or bonus token, so every step yields >= 1.
"""

from dataclasses import dataclass

import torch

from specd.model.sampling import Sampling, sample
from specd.proto.contract import Stream, position_uniform


@dataclass(frozen=True)
class Verdict:
    accepted: int  # draft tokens kept, 0..K
    emitted: list[int]  # accepted draft tokens + the recovered or bonus token


def accept_draft(
    draft_tokens: list[int],
    p: torch.Tensor,
    q: torch.Tensor | None,
    sampling: Sampling,
    first_position: int,
) -> Verdict:
    """Decide which draft tokens to keep.

    draft_tokens: [K] guesses; draft_tokens[i] sits at sequence position first_position + i.
    p: [K+1, V] target rows: row i scores position first_position + i, penalised (sampling.py
       penalise) over everything before that position, draft_tokens[:i] included. When greedy,
       any row-wise monotone score (the penalised logits) will do; when sampling, probabilities.
    q: [K, V] draft probabilities the drafts were sampled from; None when greedy.
    """
    k = len(draft_tokens)
    assert p.shape[0] == k + 1, f"p has {p.shape[0]} rows for {k} draft tokens"
    if sampling.greedy:
        return _accept_greedy(draft_tokens, p.argmax(dim=-1).tolist())
    assert q is not None and q.shape == (k, p.shape[1]), "sampling needs q rows of p's shape"
    return _accept_sampled(draft_tokens, p, q, sampling, first_position)


def _accept_greedy(draft_tokens: list[int], target_tokens: list[int]) -> Verdict:
    """Keep drafts while they equal the target's argmax; then add the target's own token."""
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == target_tokens[accepted]:
        accepted += 1
    return Verdict(accepted, draft_tokens[:accepted] + [target_tokens[accepted]])


def _accept_sampled(draft_tokens, p, q, sampling: Sampling, first_position: int) -> Verdict:
    """Modified rejection sampling: the emitted tokens follow p exactly, whatever q is.
    p(x) and q(x) of every guess cross to the host in one copy, not one per guess."""
    rows = torch.arange(len(draft_tokens), device=p.device)
    guesses = torch.tensor(draft_tokens, dtype=torch.long, device=p.device)
    p_x, q_x = torch.stack([p[rows, guesses], q[rows, guesses]]).tolist()
    for i in range(len(draft_tokens)):
        position = first_position + i
        # Accept the guess x with probability min(1, p(x) / q(x)).
        u = position_uniform(sampling.seed, position, Stream.ACCEPT)
        if u * q_x[i] < p_x[i]:
            continue
        # Rejected: recover from the residual norm(max(0, p - q)).
        residual = torch.clamp(p[i] - q[i], min=0.0)
        recovered = sample(residual if residual.sum() > 0 else p[i], _target_u(sampling, position))
        return Verdict(i, draft_tokens[:i] + [recovered])
    bonus = sample(p[-1], _target_u(sampling, first_position + len(draft_tokens)))
    return Verdict(len(draft_tokens), list(draft_tokens) + [bonus])


def _target_u(sampling: Sampling, position: int) -> float:
    return position_uniform(sampling.seed, position, Stream.TARGET)
