"""What a model service may hold and do: its limits, and the weight quantizations it offers.

Part of the contract (ModelInfo reports the limits), and torch-free: the command line and the
cluster deployer read these on machines without torch.
"""

from dataclasses import dataclass

QUANTIZATIONS = ("none", "int8", "int4")  # weight-only schemes a model service offers (model/loading.py)
# max_cached_tokens = 0: "auto", the service derives it from its device when it loads (model/service.py):
# on a GPU what fits in the memory free after loading, on a CPU the default below.
AUTO_CACHED_TOKENS = 0


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
