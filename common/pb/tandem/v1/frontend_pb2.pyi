from common.pb.tandem.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "text", "token_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _sampling_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finish_reason", "usage", "top_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: _sampling_pb2.FinishReason
    usage: Usage
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_sampling_pb2.TopLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[_sampling_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., top_logprobs: _Optional[_Iterable[_Union[_sampling_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "context_length", "vocab_size", "block_size", "http_url")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HTTP_URL_FIELD_NUMBER: _ClassVar[int]
    name: str
    context_length: int
    vocab_size: int
    block_size: int
    http_url: str
    def __init__(self, name: _Optional[str] = ..., context_length: _Optional[int] = ..., vocab_size: _Optional[int] = ..., block_size: _Optional[int] = ..., http_url: _Optional[str] = ...) -> None: ...

class ExplainRouteResponse(_message.Message):
    __slots__ = ("mode", "prompt_tokens", "prompt_blocks", "candidates", "decode_instance_id", "prefill_instance_id", "local_prefill_reason", "decision_seconds", "text", "prefill_weight")
    MODE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_REASON_FIELD_NUMBER: _ClassVar[int]
    DECISION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    mode: str
    prompt_tokens: int
    prompt_blocks: int
    candidates: _containers.RepeatedCompositeFieldContainer[RouteCandidate]
    decode_instance_id: str
    prefill_instance_id: str
    local_prefill_reason: str
    decision_seconds: float
    text: str
    prefill_weight: float
    def __init__(self, mode: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., prompt_blocks: _Optional[int] = ..., candidates: _Optional[_Iterable[_Union[RouteCandidate, _Mapping]]] = ..., decode_instance_id: _Optional[str] = ..., prefill_instance_id: _Optional[str] = ..., local_prefill_reason: _Optional[str] = ..., decision_seconds: _Optional[float] = ..., text: _Optional[str] = ..., prefill_weight: _Optional[float] = ...) -> None: ...

class RouteCandidate(_message.Message):
    __slots__ = ("instance_id", "role", "overlap_blocks", "load", "cost", "chosen", "queued_blocks", "shared_blocks")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: str
    overlap_blocks: int
    load: float
    cost: float
    chosen: bool
    queued_blocks: float
    shared_blocks: int
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[str] = ..., overlap_blocks: _Optional[int] = ..., load: _Optional[float] = ..., cost: _Optional[float] = ..., chosen: _Optional[bool] = ..., queued_blocks: _Optional[float] = ..., shared_blocks: _Optional[int] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterStatusResponse(_message.Message):
    __slots__ = ("router_instance_id", "model", "mode", "running_requests", "migrations", "metrics_address", "workers", "weights_fingerprint", "routers")
    ROUTER_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ROUTERS_FIELD_NUMBER: _ClassVar[int]
    router_instance_id: str
    model: str
    mode: str
    running_requests: int
    migrations: int
    metrics_address: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    weights_fingerprint: str
    routers: _containers.RepeatedCompositeFieldContainer[RouterStatus]
    def __init__(self, router_instance_id: _Optional[str] = ..., model: _Optional[str] = ..., mode: _Optional[str] = ..., running_requests: _Optional[int] = ..., migrations: _Optional[int] = ..., metrics_address: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., weights_fingerprint: _Optional[str] = ..., routers: _Optional[_Iterable[_Union[RouterStatus, _Mapping]]] = ...) -> None: ...

class RouterStatus(_message.Message):
    __slots__ = ("instance_id", "address", "metrics_address", "start_time_unix")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    START_TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    metrics_address: str
    start_time_unix: float
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., start_time_unix: _Optional[float] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("instance_id", "role", "address", "state", "healthy", "consecutive_failures", "in_flight_requests", "active_blocks", "queued_prefill_tokens", "kv_capacity_blocks", "indexed_blocks", "routed_requests", "hit_rate", "metrics_address", "weights_fingerprint", "refused", "speculative_num_steps", "speculative_sampling")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    CONSECUTIVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: str
    address: str
    state: str
    healthy: bool
    consecutive_failures: int
    in_flight_requests: int
    active_blocks: int
    queued_prefill_tokens: int
    kv_capacity_blocks: int
    indexed_blocks: int
    routed_requests: int
    hit_rate: float
    metrics_address: str
    weights_fingerprint: str
    refused: str
    speculative_num_steps: int
    speculative_sampling: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., healthy: _Optional[bool] = ..., consecutive_failures: _Optional[int] = ..., in_flight_requests: _Optional[int] = ..., active_blocks: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., kv_capacity_blocks: _Optional[int] = ..., indexed_blocks: _Optional[int] = ..., routed_requests: _Optional[int] = ..., hit_rate: _Optional[float] = ..., metrics_address: _Optional[str] = ..., weights_fingerprint: _Optional[str] = ..., refused: _Optional[str] = ..., speculative_num_steps: _Optional[int] = ..., speculative_sampling: _Optional[_Iterable[str]] = ...) -> None: ...
