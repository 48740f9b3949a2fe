from specd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListReplicasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaRequest(_message.Message):
    __slots__ = ("role", "address", "drain_seconds")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    role: str
    address: str
    drain_seconds: float
    def __init__(self, role: _Optional[str] = ..., address: _Optional[str] = ..., drain_seconds: _Optional[float] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("role", "address", "in_flight", "draining")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    role: str
    address: str
    in_flight: int
    draining: bool
    def __init__(self, role: _Optional[str] = ..., address: _Optional[str] = ..., in_flight: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class ReplicaList(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "max_new_tokens", "sampling", "stop", "draft_tokens", "ignore_eos", "drafter", "logprobs", "top_logprobs", "prompt_logprobs", "draft_ahead", "cache_salt")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: _common_pb2.SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    draft_tokens: int
    ignore_eos: bool
    drafter: str
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: bool
    draft_ahead: str
    cache_salt: str
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., draft_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., drafter: _Optional[str] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., draft_ahead: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("delta", "final")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    delta: Delta
    final: Final
    def __init__(self, delta: _Optional[_Union[Delta, _Mapping]] = ..., final: _Optional[_Union[Final, _Mapping]] = ...) -> None: ...

class Delta(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("finish_reason", "usage", "stats", "seed")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    usage: Usage
    stats: SpeculationStats
    seed: int
    def __init__(self, finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stats: _Optional[_Union[SpeculationStats, _Mapping]] = ..., seed: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("draft_tokens", "steps", "drafted", "accepted", "acceptance_rate", "mean_accepted_length", "accepted_per_position", "draft_seconds", "verify_seconds", "other_seconds", "tokens_per_s", "resyncs", "time_to_first_token_s", "adaptive", "draft_lengths", "drafting_steps", "network_seconds", "step_draft_seconds", "step_verify_seconds", "drafter", "lookup_steps", "lookup_drafted", "lookup_accepted", "ahead_steps", "ahead_ready", "ahead_late", "ahead_wasted_tokens", "ahead_hidden_seconds", "target", "draft", "migrations", "draft_moves")
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OTHER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    DRAFTING_STEPS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    AHEAD_STEPS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_READY_FIELD_NUMBER: _ClassVar[int]
    AHEAD_LATE_FIELD_NUMBER: _ClassVar[int]
    AHEAD_WASTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_HIDDEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MOVES_FIELD_NUMBER: _ClassVar[int]
    draft_tokens: int
    steps: int
    drafted: int
    accepted: int
    acceptance_rate: float
    mean_accepted_length: float
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    draft_seconds: float
    verify_seconds: float
    other_seconds: float
    tokens_per_s: float
    resyncs: int
    time_to_first_token_s: float
    adaptive: bool
    draft_lengths: _containers.RepeatedScalarFieldContainer[int]
    drafting_steps: int
    network_seconds: float
    step_draft_seconds: _containers.RepeatedScalarFieldContainer[float]
    step_verify_seconds: _containers.RepeatedScalarFieldContainer[float]
    drafter: str
    lookup_steps: int
    lookup_drafted: int
    lookup_accepted: int
    ahead_steps: int
    ahead_ready: int
    ahead_late: int
    ahead_wasted_tokens: int
    ahead_hidden_seconds: float
    target: str
    draft: str
    migrations: int
    draft_moves: int
    def __init__(self, draft_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., draft_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ..., other_seconds: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., resyncs: _Optional[int] = ..., time_to_first_token_s: _Optional[float] = ..., adaptive: _Optional[bool] = ..., draft_lengths: _Optional[_Iterable[int]] = ..., drafting_steps: _Optional[int] = ..., network_seconds: _Optional[float] = ..., step_draft_seconds: _Optional[_Iterable[float]] = ..., step_verify_seconds: _Optional[_Iterable[float]] = ..., drafter: _Optional[str] = ..., lookup_steps: _Optional[int] = ..., lookup_drafted: _Optional[int] = ..., lookup_accepted: _Optional[int] = ..., ahead_steps: _Optional[int] = ..., ahead_ready: _Optional[int] = ..., ahead_late: _Optional[int] = ..., ahead_wasted_tokens: _Optional[int] = ..., ahead_hidden_seconds: _Optional[float] = ..., target: _Optional[str] = ..., draft: _Optional[str] = ..., migrations: _Optional[int] = ..., draft_moves: _Optional[int] = ...) -> None: ...

class OrchestratorInfo(_message.Message):
    __slots__ = ("draft", "target", "default_draft_tokens", "workers", "adaptive_draft_tokens", "max_draft_tokens", "drafter", "draft_ahead")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_FIELD_NUMBER: _ClassVar[int]
    draft: _common_pb2.ModelInfo
    target: _common_pb2.ModelInfo
    default_draft_tokens: int
    workers: int
    adaptive_draft_tokens: bool
    max_draft_tokens: int
    drafter: str
    draft_ahead: str
    def __init__(self, draft: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., target: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., default_draft_tokens: _Optional[int] = ..., workers: _Optional[int] = ..., adaptive_draft_tokens: _Optional[bool] = ..., max_draft_tokens: _Optional[int] = ..., drafter: _Optional[str] = ..., draft_ahead: _Optional[str] = ...) -> None: ...
