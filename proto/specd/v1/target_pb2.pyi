from specd.v1 import common_pb2 as _common_pb2
from specd.v1 import draft_pb2 as _draft_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyRequest(_message.Message):
    __slots__ = ("cursor", "draft_tokens", "q", "sampling", "return_logprobs", "top_logprobs")
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    cursor: _common_pb2.SessionCursor
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[_draft_pb2.SparseDistribution]
    sampling: _common_pb2.SamplingParams
    return_logprobs: bool
    top_logprobs: int
    def __init__(self, cursor: _Optional[_Union[_common_pb2.SessionCursor, _Mapping]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[_draft_pb2.SparseDistribution, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., return_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("cursor", "sampling", "return_logprobs", "top_logprobs", "prompt_logprobs", "steps", "stop_token_ids")
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    cursor: _common_pb2.SessionCursor
    sampling: _common_pb2.SamplingParams
    return_logprobs: bool
    top_logprobs: int
    prompt_logprobs: bool
    steps: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, cursor: _Optional[_Union[_common_pb2.SessionCursor, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., return_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., steps: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("accepted", "emitted_tokens", "logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs", "cached_tokens", "cached_prompt_tokens")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    EMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    emitted_tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    cached_tokens: int
    cached_prompt_tokens: int
    def __init__(self, accepted: _Optional[int] = ..., emitted_tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., cached_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...
