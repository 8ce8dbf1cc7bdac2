from common.pb.tandem.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AbandonRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbandonResponse(_message.Message):
    __slots__ = ("notified",)
    NOTIFIED_FIELD_NUMBER: _ClassVar[int]
    notified: bool
    def __init__(self, notified: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "destination", "sampling_step_offset", "return_last_hidden", "cache_salt", "notification_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_STEP_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RETURN_LAST_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    NOTIFICATION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _sampling_pb2.SamplingParams
    destination: KvDestination
    sampling_step_offset: int
    return_last_hidden: bool
    cache_salt: str
    notification_token: bytes
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., destination: _Optional[_Union[KvDestination, _Mapping]] = ..., sampling_step_offset: _Optional[int] = ..., return_last_hidden: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., notification_token: _Optional[bytes] = ...) -> None: ...

class KvDestination(_message.Message):
    __slots__ = ("backend", "agent_name", "agent_metadata", "base_address", "block_stride_bytes", "device_id", "first_block_index", "block_ids", "kv_cache_dtype", "kv_cache_scale")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SCALE_FIELD_NUMBER: _ClassVar[int]
    backend: str
    agent_name: str
    agent_metadata: bytes
    base_address: int
    block_stride_bytes: int
    device_id: int
    first_block_index: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_cache_dtype: str
    kv_cache_scale: float
    def __init__(self, backend: _Optional[str] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., base_address: _Optional[int] = ..., block_stride_bytes: _Optional[int] = ..., device_id: _Optional[int] = ..., first_block_index: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., kv_cache_dtype: _Optional[str] = ..., kv_cache_scale: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_token_logprob", "cached_tokens", "transfer_bytes", "transfer_seconds", "last_hidden", "first_token_top_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_token_logprob: float
    cached_tokens: int
    transfer_bytes: int
    transfer_seconds: float
    last_hidden: bytes
    first_token_top_logprobs: _sampling_pb2.TopLogprobs
    def __init__(self, first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., transfer_bytes: _Optional[int] = ..., transfer_seconds: _Optional[float] = ..., last_hidden: _Optional[bytes] = ..., first_token_top_logprobs: _Optional[_Union[_sampling_pb2.TopLogprobs, _Mapping]] = ...) -> None: ...
