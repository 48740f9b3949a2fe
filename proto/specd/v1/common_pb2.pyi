from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionCursor(_message.Message):
    __slots__ = ("session_id", "start", "fingerprint", "tokens", "cache_salt")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    start: int
    fingerprint: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, session_id: _Optional[str] = ..., start: _Optional[int] = ..., fingerprint: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "prompt_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    prompt_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "role", "vocab_size", "tokenizer_fingerprint", "dtype", "max_session_tokens", "max_sessions", "max_cached_tokens", "max_draft_tokens", "eos_token_ids", "live_sessions", "cached_tokens", "max_batch_size", "max_batch_tokens", "batch_sizes", "queued_calls", "quantization", "device", "device_name", "device_memory_total_bytes", "device_memory_free_bytes", "batched_tokens", "max_q_bytes", "prefix_cache_budget_tokens", "prefix_cache_tokens", "prefix_cache_entries", "prefix_cache_blocks", "prefix_cache_bytes", "prefix_cache_hit_tokens", "prefix_cache_miss_tokens", "prefix_cache_evictions", "prefix_cache_failures", "pass_seconds", "prefill_seconds_per_token", "prefix_cache_answers", "scored_per_call", "pass_positions", "splits_rows")
    class BatchSizesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_CALLS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_Q_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_MISS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    PASS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_ANSWERS_FIELD_NUMBER: _ClassVar[int]
    SCORED_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    PASS_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SPLITS_ROWS_FIELD_NUMBER: _ClassVar[int]
    model: str
    role: str
    vocab_size: int
    tokenizer_fingerprint: str
    dtype: str
    max_session_tokens: int
    max_sessions: int
    max_cached_tokens: int
    max_draft_tokens: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    live_sessions: int
    cached_tokens: int
    max_batch_size: int
    max_batch_tokens: int
    batch_sizes: _containers.ScalarMap[int, int]
    queued_calls: int
    quantization: str
    device: str
    device_name: str
    device_memory_total_bytes: int
    device_memory_free_bytes: int
    batched_tokens: int
    max_q_bytes: int
    prefix_cache_budget_tokens: int
    prefix_cache_tokens: int
    prefix_cache_entries: int
    prefix_cache_blocks: int
    prefix_cache_bytes: int
    prefix_cache_hit_tokens: int
    prefix_cache_miss_tokens: int
    prefix_cache_evictions: int
    prefix_cache_failures: int
    pass_seconds: _containers.RepeatedScalarFieldContainer[float]
    prefill_seconds_per_token: float
    prefix_cache_answers: int
    scored_per_call: int
    pass_positions: _containers.RepeatedScalarFieldContainer[int]
    splits_rows: bool
    def __init__(self, model: _Optional[str] = ..., role: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., max_session_tokens: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_cached_tokens: _Optional[int] = ..., max_draft_tokens: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., live_sessions: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ..., batch_sizes: _Optional[_Mapping[int, int]] = ..., queued_calls: _Optional[int] = ..., quantization: _Optional[str] = ..., device: _Optional[str] = ..., device_name: _Optional[str] = ..., device_memory_total_bytes: _Optional[int] = ..., device_memory_free_bytes: _Optional[int] = ..., batched_tokens: _Optional[int] = ..., max_q_bytes: _Optional[int] = ..., prefix_cache_budget_tokens: _Optional[int] = ..., prefix_cache_tokens: _Optional[int] = ..., prefix_cache_entries: _Optional[int] = ..., prefix_cache_blocks: _Optional[int] = ..., prefix_cache_bytes: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., prefix_cache_miss_tokens: _Optional[int] = ..., prefix_cache_evictions: _Optional[int] = ..., prefix_cache_failures: _Optional[int] = ..., pass_seconds: _Optional[_Iterable[float]] = ..., prefill_seconds_per_token: _Optional[float] = ..., prefix_cache_answers: _Optional[int] = ..., scored_per_call: _Optional[int] = ..., pass_positions: _Optional[_Iterable[int]] = ..., splits_rows: _Optional[bool] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("cursor",)
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    cursor: SessionCursor
    def __init__(self, cursor: _Optional[_Union[SessionCursor, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("cached_tokens",)
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    def __init__(self, cached_tokens: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "committed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    committed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., committed: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class TokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerResponse(_message.Message):
    __slots__ = ("files",)
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    FILES_FIELD_NUMBER: _ClassVar[int]
    files: _containers.ScalarMap[str, bytes]
    def __init__(self, files: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...
