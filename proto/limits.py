"""What a model service may hold and do: its limits, and the weight quantizations it offers.

Part of the contract (ModelInfo reports the limits), and torch-free: the command line and the
cluster deployer read these on machines without torch. Also the size of the draft's q rows on the
wire, which both the draft (its --max-q-bytes) and the orchestrator (the K it asks for) compute.
"""

from dataclasses import dataclass

QUANTIZATIONS = ("none", "int8", "int4")  # weight-only schemes a model service offers (model/loading.py)
ENGINES = ("auto", "transformers", "llama.cpp")  # what a model service runs its model on (--engine)
SIM_ENGINE = "sim"  # --engine sim[:profile=gpu|cpu,alpha=A,scale=S]: passes simulated (model/sim_engine.py), never auto
# --exactness, the llama.cpp engine's (model/llama_cpp_engine.py): "bitwise", every scored position exactly
# as a lone decode step scores it (greedy output equal to target-only decoding at any load); "batched",
# the positions of a pass in one llama_decode call, rounded as the batch's shape has it (as llama-server,
# vLLM and every batching server round), faster under load.
EXACTNESS = ("bitwise", "batched")
# max_cached_tokens = 0: "auto", the service derives it from its device when it loads (model/service.py):
# on a GPU what fits in the memory free after loading, on a CPU the default below.
AUTO_CACHED_TOKENS = 0
AUTO_PREFIX_TOKENS = -1  # --prefix-cache-tokens left out: the service sizes its prefix cache (model/service.py)
MAX_CACHE_SALT_CHARS = 256  # a request's cache_salt (GenerateRequest, SessionCursor): longer is INVALID_ARGUMENT
# gRPC's message limit, send and receive, on the services and on the orchestrator's channels to them:
# past gRPC's 4 MiB default for the tokenizer files (Qwen2.5's tokenizer.json is 11 MB) and the q rows.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# The largest --max-q-bytes: half a message, so the Verify that carries the rows on to the target,
# with its cursor's tokens, always fits.
MAX_Q_BYTES = MAX_MESSAGE_BYTES // 2
# The longest Decode run (target.proto DecodeRequest.steps): tokens one call may emit.
MAX_DECODE_STEPS = 64


# Penalties and logit_bias (common.proto SamplingParams), as OpenAI and vLLM bound them.
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2]
MAX_REPETITION_PENALTY = 2.0  # repetition_penalty lies in (0, 2]; 0 on the wire means 1 (off)
MAX_LOGIT_BIAS = 100.0  # each bias lies in [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit on logit_bias


def penalty_problem(
    presence: float, frequency: float, repetition: float, logit_bias: dict[int, float], vocab_size: int | None
) -> tuple[str, str] | None:
    """(the field, what is wrong) for penalties or a logit_bias outside the bounds above, else None.
    One check for the orchestrator, the HTTP layer and both services; `repetition` as the client
    means it (1 is off; the wire's 0 is read as 1 before); `vocab_size` None skips the id check."""
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            return name, f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 is off), got {value}"
    if not 0 < repetition <= MAX_REPETITION_PENALTY:
        bounds = f"(0, {MAX_REPETITION_PENALTY:g}] (1 is off)"
        return "repetition_penalty", f"repetition_penalty must be in {bounds}, got {repetition}"
    if len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        return "logit_bias", f"logit_bias holds {len(logit_bias)} entries, at most {MAX_LOGIT_BIAS_ENTRIES} are allowed"
    for token, bias in logit_bias.items():
        if vocab_size is not None and not 0 <= token < vocab_size:
            return "logit_bias", f"logit_bias token id {token} is outside the vocabulary of {vocab_size}"
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            bounds = f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
            return "logit_bias", f"logit_bias of token {token} must be in {bounds}, got {bias}"
    return None


@dataclass(frozen=True)
class Limits:
    max_sessions: int = 64  # live sessions at once
    max_cached_tokens: int = 262_144  # KV-cached tokens over all sessions
    max_session_tokens: int = 8192  # one session's length (prompt + output + drafts)
    max_draft_tokens: int = 16  # largest K
    idle_timeout_s: float = 300.0  # sessions untouched this long are evicted
    max_batch_size: int = 16  # calls sharing one forward pass
    max_batch_tokens: int = 256  # new tokens in one batched pass
    batch_wait_ms: float = 10.0  # how long a pass may wait for the sessions the last one served
    max_q_bytes: int = 4 * 1024 * 1024  # the draft's: q rows of one sampled Propose reply, as encoded (q_bytes)
    # Tokens of prompt KV the prefix cache keeps beyond the live sessions (model/prefix_cache.py);
    # AUTO_PREFIX_TOKENS: min(16384, max_cached_tokens // 4); 0 turns the store off.
    prefix_cache_tokens: int = AUTO_PREFIX_TOKENS


# -- q rows on the wire ---------------------------------------------------------------------------
# A q row is a SparseDistribution (draft.proto): its token ids as packed varints (1 to 3 bytes each
# below 2^21), 4 bytes of float32 each, in a `q` entry of the ProposeResponse. A sampled row keeps at
# most min(top_k, V) entries (top_k 0: V), fewer after pruning, so K and top_k bound a reply's rows
# before anything is computed.


def q_row_entries(top_k: int, vocab_size: int) -> int:
    """The most entries a q row has when sampling at this top_k (0: off, the whole vocabulary)."""
    return top_k if 0 < top_k < vocab_size else vocab_size


def q_row_bytes(entries: int, vocab_size: int) -> int:
    """The most bytes one q row of `entries` ids takes in a ProposeResponse, framing included:
    as if its ids were the vocabulary's highest (the longest varints)."""
    ids = _ids_bytes(vocab_size - entries, vocab_size)
    inner = _field_bytes(ids) + _field_bytes(4 * entries)
    return _field_bytes(inner)


def q_bytes(k: int, top_k: int, vocab_size: int) -> int:
    """The most bytes the K q rows of one sampled Propose reply take (what --max-q-bytes bounds)."""
    return k * q_row_bytes(q_row_entries(top_k, vocab_size), vocab_size)


def q_draft_tokens(max_q_bytes: int, top_k: int, vocab_size: int) -> int:
    """The largest K whose q rows at this top_k fit in max_q_bytes (0: not even one row)."""
    return max_q_bytes // q_row_bytes(q_row_entries(top_k, vocab_size), vocab_size)


def q_top_k(max_q_bytes: int, k: int, vocab_size: int) -> int:
    """The largest top_k at which K q rows fit in max_q_bytes (0: none does)."""
    low, high = 0, vocab_size  # q_row_bytes grows with the entries: bisect
    while low < high:
        middle = (low + high + 1) // 2
        if k * q_row_bytes(middle, vocab_size) <= max_q_bytes:
            low = middle
        else:
            high = middle - 1
    return low


def _varint_bytes(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def _field_bytes(payload: int) -> int:
    """A length-delimited field with a 1-byte tag: tag, length, payload."""
    return 1 + _varint_bytes(payload) + payload


def _ids_bytes(low: int, high: int) -> int:
    """The varint bytes of every id in low..high-1."""
    total, start, width = 0, 0, 1
    while start < high:
        end = 1 << (7 * width)  # ids below this take `width` bytes
        total += width * max(0, min(high, end) - max(low, start))
        start, width = end, width + 1
    return total


def is_sim_engine(choice: str) -> bool:
    """Whether an --engine choice names the simulated engine (its options are checked when it loads)."""
    return choice == SIM_ENGINE or choice.startswith(SIM_ENGINE + ":")
