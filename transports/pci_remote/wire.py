"""The protobuf wire form of bulk-data messages, built and read with one copy of the payload.

A streamed chunk is a message holding one bytes field (`WriteRequest.data` after a stream's first
message, `ReadReply.data`). Through the upb backend a 4 MiB chunk is copied three or four times on
its way between memory and the wire (into the message's arena, out of it, and into the serialised
bytes); here it is copied once, straight from or to the memory it belongs to. Any other shape is
left to protobuf, so both forms decode to the same values.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import numpy as np

from tinydist.transports.pci_remote._generated import device_pb2 as pb

# Trailing metadata of a failed call, for what its status alone does not tell the client
# (tinydist.runtime.remote.errors reads them): the class name of the failure, and for
# TenantWorkerFailed the tenant, the cause and whether the worker died ("1") or one request failed ("0").
ERROR_METADATA = "tinydist-error"
TENANT_METADATA = "tinydist-tenant"
CAUSE_METADATA = "tinydist-cause"
FATAL_METADATA = "tinydist-fatal"

_LENGTH_DELIMITED = 2
_MAX_VARINT_BYTES = 10


def memory(address: int, nbytes: int) -> memoryview:
    """A writable byte view of `nbytes` of process memory at `address` (no copy)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def copy_into(address: int, data: bytes | memoryview) -> None:
    """Copy `data` to process memory at `address` with the GIL released (a memoryview assignment
    would hold it through the whole copy, stalling the other side of the stream)."""
    source = np.frombuffer(data, np.uint8)
    ctypes.memmove(address, source.ctypes.data, source.nbytes)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def bytes_field(number: int, data: bytes | memoryview) -> bytes:
    """The encoding of a message whose only field is bytes field `number` = `data` (one copy)."""
    return b"".join((_varint(number << 3 | _LENGTH_DELIMITED), _varint(memoryview(data).nbytes), data))


def only_bytes_field(raw: bytes, number: int) -> memoryview | None:
    """The payload if `raw` is exactly one bytes field `number` (a view of `raw`, no copy); None
    for every other shape, which the caller parses with protobuf."""
    if number >= 16:
        raise ValueError(f"field number {number} needs a multi-byte tag; only fields 1-15 are read here")
    if not raw or raw[0] != number << 3 | _LENGTH_DELIMITED:
        return None
    length = shift = 0
    for i in range(1, min(len(raw), 1 + _MAX_VARINT_BYTES)):
        length |= (raw[i] & 0x7F) << shift
        shift += 7
        if not raw[i] & 0x80:
            return memoryview(raw)[i + 1:] if length == len(raw) - i - 1 else None
    return None


class DataChunk(NamedTuple):
    """A WriteRequest whose only field is `data`, as every message of a write stream after its
    first is; `data` is a view of the received message."""

    data: memoryview
    lease: bytes = b""
    handle: bytes = b""
    offset: int = 0


_WRITE_DATA = pb.WriteRequest.DESCRIPTOR.fields_by_name["data"].number
_READ_DATA = pb.ReadReply.DESCRIPTOR.fields_by_name["data"].number


def encode_write_data(data: bytes | memoryview) -> bytes:
    return bytes_field(_WRITE_DATA, data)


def decode_write_request(raw: bytes) -> pb.WriteRequest | DataChunk:
    data = only_bytes_field(raw, _WRITE_DATA)
    return pb.WriteRequest.FromString(raw) if data is None else DataChunk(data)


def encode_read_reply(data: bytes | memoryview) -> bytes:
    return bytes_field(_READ_DATA, data)


def decode_read_reply(raw: bytes) -> memoryview:
    """`ReadReply.data`, as a view of `raw` when the reply holds only that field."""
    data = only_bytes_field(raw, _READ_DATA)
    return memoryview(pb.ReadReply.FromString(raw).data) if data is None else data
