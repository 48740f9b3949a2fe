"""The simulated engine (`--engine sim`, never chosen by `auto`): real services, real gRPC, real
sessions, KV bookkeeping and prefix cache, but a pass computes nothing. It waits for what the
profile says such a pass costs and returns logits made from the context alone, so that one small
machine runs many replicas (the replica pools and their routing, request migration). Anchors: NVIDIA
Dynamo's mocker, llm-d's inference simulator. Every figure it produces is simulated and says so.

A pass costs `pass_s + row_token_s · (positions scored) + prefill_token_s · (prompt positions)`,
times `scale`; both roles' costs come from the profile (`PROFILES`), measured:
- `gpu`: the default pair on an NVIDIA H200 with CUDA graphs (docs/results/gpu_check_real_pair.json):
  a target decode 4.2 ms, a verify of K = 4 4.9 ms, so 4.0 ms a pass and 0.16 ms a position. The
  draft was not timed alone there: its pass is priced at the same launch-bound 4.0 ms (a 0.5B
  model's step on a GPU is kernel launches, as the target's is) and a third of the target's cost a
  position (a third of the parameters).
- `cpu`: the default target on the llama.cpp engine, 2 cores of an AMD EPYC Zen 5 (family 26,
  AVX-512), bitwise exactness (docs/performance/under-load.md): one row 33 ms, 16 rows 325 ms (13 ms a
  pass and 20 ms a row), a prompt 7.3 ms a token; the draft at a third of each.
`scale` stretches time alike for every pass (ratios are unchanged): 16 replicas of a GPU profile on 2
cores would otherwise spend more on gRPC and Python than on the simulated passes.

Logits are one-hot (a logit of `PEAK` on one token, 0 elsewhere) at a token drawn from a hash of the
session's last `CONTEXT` tokens and its length: the same context gives the same token on every
replica and in every pass, so greedy output is a function of the prompt, as with a real model, and a
migrated or re-prefilled request continues alike. The draft guesses the target's token when another
hash of the context falls under `alpha`, else another token, deterministic per context: `alpha` is the
chance that a guess is accepted once those before it were (the α of E[tokens] = (1 − α^(K+1)) / (1 − α),
orchestrator/pricing.py), so a request's accepted / drafted at K guesses comes out at
(α + … + α^K) / K. The tokens are ordinary vocabulary ids (no special tokens: EOS never comes).
"""

import hashlib
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedTokenizerBase

from specd.model.engine import ModelDescription, Row
from specd.model.loaded import tokenizer_files, tokenizer_fingerprint

CONTEXT = 8  # the tokens before a position that decide its token
PEAK = 40.0  # the chosen token's logit: its probability is 1 - e^-40·vocab, so sampling picks it too
MAX_POSITIONS = 32_768


@dataclass(frozen=True)
class SimCosts:
    """What one role's pass costs, in seconds (before `scale`)."""

    pass_s: float  # a pass, whatever it carries: reading the weights, launching the kernels
    row_token_s: float  # each position a pass scores (keeps logits for: a decode step, a verify's K + 1)
    prefill_token_s: float  # each position before those (a prompt, a catch-up)


@dataclass(frozen=True)
class SimSettings:
    """`--engine sim[:key=value,...]`: profile (gpu or cpu), alpha (the draft's agreement), scale."""

    profile: str = "gpu"
    alpha: float = 0.8
    scale: float = 1.0

    @classmethod
    def parse(cls, choice: str) -> "SimSettings":
        """`sim`, or `sim:profile=cpu,alpha=0.7,scale=20`; a clear error for anything else."""
        name, _, options = choice.partition(":")
        if name != "sim":
            raise ValueError(f"not a simulated engine: {choice!r}")
        settings = cls()
        for option in filter(None, options.split(",")):
            key, _, value = option.partition("=")
            if key == "profile" and value in PROFILES:
                settings = replace(settings, profile=value)
            elif key in ("alpha", "scale") and _number(value) is not None:
                settings = replace(settings, **{key: _number(value)})
            else:
                raise ValueError(
                    f"--engine sim takes profile={'|'.join(PROFILES)}, alpha=A (0..1) and scale=S (> 0), "
                    f"comma-separated after 'sim:'; not {option!r}"
                )
        if not 0 <= settings.alpha <= 1 or settings.scale <= 0:
            raise ValueError(f"--engine sim: alpha must be in 0..1 and scale > 0, got {choice!r}")
        return settings


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


PROFILES: dict[str, dict[str, SimCosts]] = {
    "gpu": {"target": SimCosts(0.0040, 0.00016, 0.00016), "draft": SimCosts(0.0040, 0.000053, 0.000053)},
    "cpu": {"target": SimCosts(0.013, 0.020, 0.0073), "draft": SimCosts(0.0043, 0.0067, 0.0024)},
}


def _hash(salt: bytes, context: tuple[bytes, ...]) -> int:
    return int.from_bytes(hashlib.blake2b(b"".join((salt, *context)), digest_size=8).digest(), "little")


class SimEngine:
    """The Engine (model/engine.py), simulated: a session's KV is the list of its tokens."""

    copies_take_kv_memory = False  # a copy is a list of ints in host memory

    def __init__(self, role: str, name: str, tokenizer: PreTrainedTokenizerBase, settings: SimSettings):
        if role not in ("draft", "target"):
            raise ValueError(f"a simulated engine is a draft or a target, not {role!r}")
        self.role, self.settings, self.tokenizer = role, settings, tokenizer
        self.costs = PROFILES[settings.profile][role]
        self.tokens_range = tokenizer.vocab_size  # ordinary tokens only: no special token comes out
        self.vocab_size = len(tokenizer)
        self.kv: dict[str, list[int]] = {}
        self.description = ModelDescription(
            name=name,
            vocab_size=self.vocab_size,
            max_positions=MAX_POSITIONS,
            dtype=f"simulated ({settings.profile}, scale {settings.scale:g})",
            device="cpu",  # its logits are host tensors; dtype says it is simulated
            eos_token_ids=sorted({tokenizer.eos_token_id} - {None}),
            tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
            quantization="none",
            padded=False,
        )

    def seconds(self, rows: list[Row]) -> float:
        """What a pass over these rows costs, scaled."""
        scored = sum(row.keep_logits for row in rows)
        prefilled = sum(len(row.tokens) - row.keep_logits for row in rows)
        costs = self.costs
        return self.settings.scale * (costs.pass_s + costs.row_token_s * scored + costs.prefill_token_s * prefilled)

    def modelled_pass_seconds(self, tokens: int, scored: int) -> float:
        """What a pass of one session's `tokens` new tokens, the last `scored` of them scored, costs here
        (model/pass_profile.py asks this instead of measuring: a simulated pass costs what its profile says)."""
        return self.seconds([Row("", [0] * tokens, scored)])

    def forward(self, rows: list[Row]) -> list[torch.Tensor]:
        started = time.perf_counter()
        out = []
        for row in rows:
            held = self.kv.setdefault(row.session_id, [])
            held.extend(row.tokens)
            first = len(held) - row.keep_logits
            logits = torch.zeros(row.keep_logits, self.vocab_size)
            for keep, end in enumerate(range(first + 1, len(held) + 1)):
                logits[keep, self.next_token(held, end)] = PEAK
            out.append(logits)
        left = self.seconds(rows) - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)
        return out

    def next_token(self, tokens: list[int], end: int) -> int:
        """This role's token after tokens[:end]: the target's from a hash of that context; the draft's
        the same when a second hash falls under alpha, else another."""
        context = (end.to_bytes(4, "little"), *(t.to_bytes(4, "little") for t in tokens[max(0, end - CONTEXT) : end]))
        target = _hash(b"target", context) % self.tokens_range
        if self.role == "target" or _hash(b"agree", context) / 2**64 < self.settings.alpha:
            return target
        return (target + 1 + _hash(b"other", context) % (self.tokens_range - 1)) % self.tokens_range

    def passes(self, session_ids: list[str]):
        return nullcontext()

    def crop(self, session_id: str, length: int) -> None:
        if session_id in self.kv:
            del self.kv[session_id][length:]

    def release(self, session_id: str) -> None:
        self.kv.pop(session_id, None)

    def kv_token_budget(self) -> int | None:
        return None

    def tokenizer_files(self) -> dict[str, bytes]:
        return tokenizer_files(self.tokenizer)

    # -- the prefix cache (model/prefix_cache.py): a copy is the tokens themselves -----------------

    def reusable(self, session_id: str) -> int:
        return len(self.kv.get(session_id, []))

    def snapshot(self, session_id: str, length: int) -> "SimSnapshot":
        return SimSnapshot(list(self.kv[session_id][:length]))

    def restore(self, session_id: str, snapshot: "SimSnapshot", length: int) -> None:
        self.kv[session_id] = list(snapshot.tokens[:length])


@dataclass
class SimSnapshot:
    tokens: list[int]

    @property
    def nbytes(self) -> int:
        return 8 * len(self.tokens)

    @property
    def held_tokens(self) -> int:
        return len(self.tokens)
