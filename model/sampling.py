"""Sampling maths shared by draft and target: logits -> probabilities, and seeded draws.

Every draw takes its uniform from `specd.proto.contract.position_uniform(seed, position, stream)`,
so a token depends on (request seed, position), never on call order or retries.
"""

from dataclasses import dataclass

import torch

from specd.proto.contract import position_uniform

# q entries below this are dropped before the draft samples, so q rows travel compactly;
# the draft samples from the pruned row itself, so the rejection rule stays exact.
Q_PRUNE_BELOW = 1e-6


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass, (0, 1]
    top_k: int = 0  # 0 = off
    seed: int = 0  # request seed

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs_from_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature, top-k, top-p."""
    logits = logits.float() / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        probs = _keep_nucleus(probs, sampling.top_p)
    return probs


def _keep_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest set whose mass reaches top_p; renormalise."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)  # the top token always stays
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def sample(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from an unnormalised [V] row with the uniform u in [0, 1), on the row's
    device; only the drawn index comes back to the host."""
    cdf = torch.cumsum(probs.double(), dim=0)
    index = torch.searchsorted(cdf, cdf[-1:] * u, right=True)
    return int(index.clamp(max=probs.shape[0] - 1))


def draw(probs: torch.Tensor, sampling: Sampling, position: int, stream: int) -> int:
    """Draw the token at `position` of a sequence from one probability row."""
    return sample(probs, position_uniform(sampling.seed, position, stream))


def prune_q(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[V] q row -> (token ids, renormalised probs) of the entries worth sending."""
    token_ids = torch.nonzero(probs >= Q_PRUNE_BELOW).flatten()
    if token_ids.numel() == 0:  # a flat row over a huge vocabulary: keep its best token
        token_ids = probs.argmax().reshape(1)
    kept = probs[token_ids]
    return token_ids, kept / kept.sum()


def densify(token_ids: torch.Tensor, probs: torch.Tensor, vocab_size: int, device: torch.device | str = "cpu"):
    """Inverse of prune_q: a dense [V] float32 row on `device`."""
    row = torch.zeros(vocab_size, dtype=torch.float32, device=device)
    return row.index_put_((token_ids.to(device).long(),), probs.to(device).float())
