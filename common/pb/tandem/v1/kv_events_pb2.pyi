from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchLoadRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("requests", "active_blocks", "queued_prefill_tokens")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    requests: int
    active_blocks: int
    queued_prefill_tokens: int
    def __init__(self, requests: _Optional[int] = ..., active_blocks: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("from_event_id", "incarnation")
    FROM_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    from_event_id: int
    incarnation: int
    def __init__(self, from_event_id: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("event_id", "snapshot", "events", "incarnation")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    event_id: int
    snapshot: bool
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    incarnation: int
    def __init__(self, event_id: _Optional[int] = ..., snapshot: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., incarnation: _Optional[int] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("parent_hash", "block_hashes")
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    parent_hash: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, parent_hash: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
