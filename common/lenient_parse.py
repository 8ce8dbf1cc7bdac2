"""Name the field when a request carries invalid UTF-8 in a `string` field.

protobuf's parser rejects such a message as a whole ("Error parsing message"), which grpc
would answer with a nameless INTERNAL error. Servers register their methods with
`deserializer(MessageClass)`: a failed parse yields an `Unparsable` whose `field` names the
culprit, found by re-parsing with a copy of the message where every string is bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message


@dataclass(frozen=True)
class Unparsable:
    """A request that failed to parse; `field` is e.g. "text" or "sampling.stop[0]"."""

    field: str
    reason: str


@lru_cache(maxsize=None)
def _lenient_class(full_name: str, file_names: tuple[str, ...]) -> type[Message]:
    pool = descriptor_pool.DescriptorPool()
    default = descriptor_pool.Default()
    for name in file_names:  # dependencies first
        fdp = descriptor_pb2.FileDescriptorProto()
        default.FindFileByName(name).CopyToProto(fdp)
        for msg in fdp.message_type:
            for f in msg.field:
                if f.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
                    f.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
        pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(full_name))


def _files(desc: Any) -> tuple[str, ...]:
    order: list[str] = []

    def visit(f: Any) -> None:
        for dep in f.dependencies:
            visit(dep)
        if f.name not in order:
            order.append(f.name)

    visit(desc.file)
    return tuple(order)


def _find_bad_utf8(msg: Message, prefix: str = "") -> str | None:
    for fd, value in msg.ListFields():
        path = prefix + fd.name
        repeated = fd.is_repeated
        values = list(value) if repeated else [value]
        for i, v in enumerate(values):
            where = f"{path}[{i}]" if repeated else path
            if isinstance(v, bytes):
                try:
                    v.decode("utf-8")
                except UnicodeDecodeError:
                    return where
            elif isinstance(v, Message):
                bad = _find_bad_utf8(v, where + ".")
                if bad:
                    return bad
    return None


def deserializer(cls: type[Message]) -> Callable[[bytes], Message | Unparsable]:
    """A grpc request deserializer for cls that returns Unparsable instead of raising."""

    def parse(data: bytes) -> Message | Unparsable:
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            try:
                lenient = _lenient_class(cls.DESCRIPTOR.full_name, _files(cls.DESCRIPTOR)).FromString(data)
            except DecodeError:
                return Unparsable("request", f"malformed protobuf: {exc}")
            bad = _find_bad_utf8(lenient)
            if bad is None:
                return Unparsable("request", f"malformed protobuf: {exc}")
            return Unparsable(bad, "not valid UTF-8")

    return parse
