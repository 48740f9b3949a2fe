"""Sampling maths shared by draft and target: logits -> penalised logits -> probabilities, and seeded draws.

Every draw takes its uniform from `specd.proto.contract.position_uniform(seed, position, stream)`,
so a token depends on (request seed, position), never on call order or retries.

Penalties and logit_bias (`penalise`) change the distribution a position is drawn from, as a
function of the tokens before it. Speculation stays exact for any such distribution as long as each
row of p (and of q) is computed over the whole sequence before its position, guesses included: row j
of a verify sees the committed tokens plus the first j guesses (docs/architecture.md §4).
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specd.model.errors import InvalidRequest
from specd.proto.contract import position_uniform
from specd.proto.limits import penalty_problem

# q entries below this are dropped before the draft samples, so q rows travel compactly;
# the draft samples from the pruned row itself, so the rejection rule stays exact.
Q_PRUNE_BELOW = 1e-6


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass, (0, 1]
    top_k: int = 0  # 0 = off
    seed: int = 0  # request seed
    presence_penalty: float = 0.0  # subtracted once from each token the output holds; 0 = off
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output; 0 = off
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of tokens seen; 1 = off
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    prompt_tokens: int = 0  # leading session tokens that are the prompt; the output follows them

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether `penalise` changes anything: when not, it costs nothing."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )


def check_penalties(sampling: Sampling, vocab_size: int) -> None:
    """Refuse penalties and biases outside OpenAI's bounds, or a bias on an id outside the vocabulary."""
    problem = penalty_problem(
        sampling.presence_penalty,
        sampling.frequency_penalty,
        sampling.repetition_penalty,
        sampling.logit_bias,
        vocab_size,
    )
    if problem:
        raise InvalidRequest(problem[1])


def penalise(
    logits: torch.Tensor, sampling: Sampling, history: Sequence[int], guesses: Sequence[int] = ()
) -> torch.Tensor:
    """[R, V] logits -> the same rows with logit_bias, then the repetition, frequency and presence
    penalties applied, in vLLM's order and before temperature, top-k and top-p (greedy takes the
    argmax of these rows). Row j scores the token after `history` + guesses[:j] (R <= len(guesses) + 1):
    a verify's K + 1 rows each see the committed tokens and the guesses before them, so each is the
    penalised distribution at its own position. Of that sequence the first sampling.prompt_tokens are
    the prompt: presence and frequency count the rest (the output), repetition counts both.
    Returns `logits` itself when nothing is set."""
    if not sampling.penalised:
        return logits
    logits = logits.to(torch.float32, copy=True)
    if sampling.logit_bias:
        ids = torch.tensor(list(sampling.logit_bias), dtype=torch.long, device=logits.device)
        logits[:, ids] += torch.tensor(list(sampling.logit_bias.values()), device=logits.device)
    if sampling.repetition_penalty == 1.0 and not (sampling.presence_penalty or sampling.frequency_penalty):
        return logits
    # Only the tokens the sequence holds are penalised: work on those columns alone ([R, U], U <= its length).
    tokens, seen, in_output = _token_counts(logits, history, guesses[: logits.shape[0] - 1], sampling.prompt_tokens)
    chosen = logits[:, tokens]
    if sampling.repetition_penalty != 1.0:
        penalty = sampling.repetition_penalty
        scaled = torch.where(chosen > 0, chosen / penalty, chosen * penalty)
        chosen = torch.where(seen > 0, scaled, chosen)
    chosen = chosen - sampling.frequency_penalty * in_output - sampling.presence_penalty * (in_output > 0)
    logits[:, tokens] = chosen
    return logits


def _token_counts(logits: torch.Tensor, history: Sequence[int], guesses: Sequence[int], prompt_tokens: int):
    """The distinct tokens U of history + guesses, and two [R, U] counts: their occurrences before
    row j's position (the history and guesses[:j]), and of those, the ones in the output."""
    rows, device = logits.shape[0], logits.device
    sequence = torch.tensor([*history, *guesses], dtype=torch.long, device=device)
    tokens, column = torch.unique(sequence, return_inverse=True)
    positions = torch.arange(len(sequence), device=device)
    before_row = positions[None, :] < len(history) + torch.arange(rows, device=device)[:, None]  # [R, length]
    in_output = before_row & (positions >= prompt_tokens)
    counts = torch.zeros(2, rows, len(tokens), device=device)
    counts[0].index_add_(1, column, before_row.float())
    counts[1].index_add_(1, column, in_output.float())
    return tokens, counts[0], counts[1]


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
