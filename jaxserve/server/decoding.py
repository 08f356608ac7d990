"""Request deserializers that turn an unparsable message into INVALID_ARGUMENT naming the field.

grpcio answers a request whose deserializer raises with INTERNAL, and protobuf refuses a
`string` field holding invalid UTF-8 without saying which field. Both are client mistakes, so
the server registers `safe_deserializer(cls)` instead of `cls.FromString`: on a parse error it
parses the bytes again as a "bytes twin" of the message (the same schema with every string
field turned into bytes, built once in a private descriptor pool) and walks it to find the
first field that is not valid UTF-8, e.g. "messages[1].content". The handler receives a
`BadMessage` instead of the request and answers it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message


@dataclasses.dataclass(frozen=True)
class BadMessage:
    field: str
    message: str


def _stringless(msg_proto: descriptor_pb2.DescriptorProto) -> None:
    for f in msg_proto.field:
        if f.type == FieldDescriptor.TYPE_STRING:
            f.type = FieldDescriptor.TYPE_BYTES
    for nested in msg_proto.nested_type:
        _stringless(nested)


@functools.lru_cache(maxsize=None)
def _twin_class(full_name: str, file_descriptor) -> type[Message]:
    fdp = descriptor_pb2.FileDescriptorProto()
    file_descriptor.CopyToProto(fdp)
    for m in fdp.message_type:
        _stringless(m)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(full_name))


def _first_bad_utf8(msg: Message, prefix: str = "") -> BadMessage | None:
    for fd, value in msg.ListFields():
        name = prefix + fd.name
        repeated = fd.is_repeated
        items = list(enumerate(value)) if repeated else [(None, value)]
        for i, v in items:
            path = name if i is None else f"{name}[{i}]"
            if fd.type == FieldDescriptor.TYPE_MESSAGE:
                bad = _first_bad_utf8(v, path + ".")
                if bad is not None:
                    return bad
            elif fd.type == FieldDescriptor.TYPE_BYTES and isinstance(v, bytes):
                try:
                    v.decode("utf-8")
                except UnicodeDecodeError as e:
                    return BadMessage(path, f"is not valid UTF-8 (byte {e.start})")
    return None


def diagnose(cls: type[Message], data: bytes) -> BadMessage:
    """Why `data` does not parse as `cls`, naming the field where possible."""
    desc = cls.DESCRIPTOR
    try:
        twin = _twin_class(desc.full_name, desc.file).FromString(data)
    except DecodeError:
        return BadMessage("request", f"is not a valid {desc.full_name} protobuf message")
    bad = _first_bad_utf8(twin)
    # The twin's bytes fields were strings in the real schema; any other failure is structural.
    return bad or BadMessage("request", f"is not a valid {desc.full_name} protobuf message")


def safe_deserializer(cls: type[Message]) -> Callable[[bytes], Message | BadMessage]:
    def deserialize(data: bytes):
        try:
            return cls.FromString(data)
        except DecodeError:
            return diagnose(cls, data)
    return deserialize
