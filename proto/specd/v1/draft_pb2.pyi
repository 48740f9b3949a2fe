from specd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeRequest(_message.Message):
    __slots__ = ("cursor", "num_draft_tokens", "sampling")
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    cursor: _common_pb2.SessionCursor
    num_draft_tokens: int
    sampling: _common_pb2.SamplingParams
    def __init__(self, cursor: _Optional[_Union[_common_pb2.SessionCursor, _Mapping]] = ..., num_draft_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: bytes
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[bytes] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("draft_tokens", "q", "cached_tokens")
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    cached_tokens: int
    def __init__(self, draft_tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...
