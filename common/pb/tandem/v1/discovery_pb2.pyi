from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_ROUTER: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]

class InstanceState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSTANCE_STATE_UNSPECIFIED: _ClassVar[InstanceState]
    INSTANCE_STATE_SERVING: _ClassVar[InstanceState]
    INSTANCE_STATE_DRAINING: _ClassVar[InstanceState]
ROLE_UNSPECIFIED: Role
ROLE_ROUTER: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
INSTANCE_STATE_UNSPECIFIED: InstanceState
INSTANCE_STATE_SERVING: InstanceState
INSTANCE_STATE_DRAINING: InstanceState

class Instance(_message.Message):
    __slots__ = ("instance_id", "role", "address", "model", "block_size", "hash_seed", "kv_capacity_blocks", "transfer_agent_name", "state", "start_time_unix", "version", "metrics_address", "http_address", "incarnation", "weights_fingerprint", "transfer_metadata_sha256", "prefill_seconds_per_token", "decode_seconds_per_kv_token", "decode_seconds_per_request", "rank_transfer_agents", "speculative_num_steps", "speculative_sampling")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    START_TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_METADATA_SHA256_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_PER_KV_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    RANK_TRANSFER_AGENTS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: Role
    address: str
    model: str
    block_size: int
    hash_seed: int
    kv_capacity_blocks: int
    transfer_agent_name: str
    state: InstanceState
    start_time_unix: float
    version: str
    metrics_address: str
    http_address: str
    incarnation: int
    weights_fingerprint: str
    transfer_metadata_sha256: bytes
    prefill_seconds_per_token: float
    decode_seconds_per_kv_token: float
    decode_seconds_per_request: float
    rank_transfer_agents: _containers.RepeatedCompositeFieldContainer[RankTransferAgent]
    speculative_num_steps: int
    speculative_sampling: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., hash_seed: _Optional[int] = ..., kv_capacity_blocks: _Optional[int] = ..., transfer_agent_name: _Optional[str] = ..., state: _Optional[_Union[InstanceState, str]] = ..., start_time_unix: _Optional[float] = ..., version: _Optional[str] = ..., metrics_address: _Optional[str] = ..., http_address: _Optional[str] = ..., incarnation: _Optional[int] = ..., weights_fingerprint: _Optional[str] = ..., transfer_metadata_sha256: _Optional[bytes] = ..., prefill_seconds_per_token: _Optional[float] = ..., decode_seconds_per_kv_token: _Optional[float] = ..., decode_seconds_per_request: _Optional[float] = ..., rank_transfer_agents: _Optional[_Iterable[_Union[RankTransferAgent, _Mapping]]] = ..., speculative_num_steps: _Optional[int] = ..., speculative_sampling: _Optional[_Iterable[str]] = ...) -> None: ...

class RankTransferAgent(_message.Message):
    __slots__ = ("name", "metadata_sha256", "capacity_blocks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    METADATA_SHA256_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    metadata_sha256: bytes
    capacity_blocks: int
    def __init__(self, name: _Optional[str] = ..., metadata_sha256: _Optional[bytes] = ..., capacity_blocks: _Optional[int] = ...) -> None: ...
