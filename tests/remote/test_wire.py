"""The one-copy wire forms of bulk messages decode to what protobuf decodes, for any bytes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from tinydist.runtime.remote.client import CHUNK_BYTES
from tinydist.runtime.remote.device import SourceChunks
from tinydist.transports.pci_remote import wire
from tinydist.transports.pci_remote._generated import device_pb2 as pb


def varint(n: int) -> bytes:  # protobuf's own: a uint64 field's encoding after its one-byte tag
    return pb.ReadRequest(offset=n).SerializeToString()[1:] if n else b"\x00"


TAGS = st.sampled_from([0x0A, 0x22, 0x12, 0x1A, 0x0B, 0x23])
# The fast path's shape (tag, length, payload) exactly, and with every mistake: wrong tags, short or
# long lengths, overlong or unfinished varints, trailing fields.
exact = st.builds(lambda tag, payload: bytes([tag]) + varint(len(payload)) + payload, TAGS, st.binary(max_size=300))
shaped = st.builds(lambda tag, length, payload, tail: bytes([tag]) + length + payload + tail, TAGS,
                   st.one_of(st.binary(max_size=11), st.integers(0, 300).map(varint)),
                   st.binary(max_size=300), st.binary(max_size=4))
raw_bytes = st.one_of(exact, shaped, st.binary(max_size=64))


def _decoded_or_error(decode: Callable[[bytes], Any], raw: bytes) -> Any:
    try:
        return decode(raw)
    except DecodeError:
        return DecodeError


@given(raw_bytes)
def test_write_request_decodes_like_protobuf(raw: bytes) -> None:
    expected = _decoded_or_error(pb.WriteRequest.FromString, raw)
    got = _decoded_or_error(wire.decode_write_request, raw)
    if expected is DecodeError:
        assert got is DecodeError
    else:
        assert (got.lease, got.handle, got.offset, bytes(got.data)) == (expected.lease, expected.handle, expected.offset,
                                                                         expected.data)


@given(raw_bytes)
def test_read_reply_decodes_like_protobuf(raw: bytes) -> None:
    expected = _decoded_or_error(pb.ReadReply.FromString, raw)
    got = _decoded_or_error(wire.decode_read_reply, raw)
    assert got is DecodeError if expected is DecodeError else bytes(got) == expected.data


@pytest.mark.parametrize("nbytes", [0, 1, 127, 128, 16383, 16384, 4 << 20])
def test_encodings_are_protobuf_messages(nbytes: int) -> None:
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    assert pb.WriteRequest.FromString(wire.encode_write_data(memoryview(data))).data == data.tobytes()
    assert pb.ReadReply.FromString(wire.encode_read_reply(memoryview(data))).data == data.tobytes()
    if nbytes:  # protobuf leaves an empty field out; the encoding here states it (both decode alike)
        assert wire.encode_read_reply(data.tobytes()) == pb.ReadReply(data=data.tobytes()).SerializeToString()
    assert isinstance(wire.decode_write_request(wire.encode_write_data(data.tobytes())), wire.DataChunk)


def test_memory_views_process_memory_and_copy_into_writes_it() -> None:
    buffer = np.zeros(16, np.uint8)
    view = wire.memory(buffer.ctypes.data + 4, 8)
    view[:] = bytes(range(8))
    assert buffer.tolist() == [0] * 4 + list(range(8)) + [0] * 4
    wire.copy_into(buffer.ctypes.data, memoryview(b"xabc")[1:])
    wire.copy_into(buffer.ctypes.data + 13, b"def")
    assert bytes(buffer) == b"abc\x00" + bytes(range(8)) + b"\x00def"


def test_only_bytes_field_refuses_multibyte_tags() -> None:
    with pytest.raises(ValueError, match="field number 16"):
        wire.only_bytes_field(b"\x82\x01\x00", 16)


def test_source_chunks_stream_host_memory_and_stop_reading_it_once_closed() -> None:
    nbytes = 2 * CHUNK_BYTES + 5
    source = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    header, *chunks = SourceChunks(b"L", b"H", 7, source.ctypes.data, nbytes)
    assert pb.WriteRequest.FromString(header) == pb.WriteRequest(lease=b"L", handle=b"H", offset=7)
    decoded = [wire.decode_write_request(c) for c in chunks]
    assert all(isinstance(d, wire.DataChunk) for d in decoded)
    assert [len(d.data) for d in decoded] == [CHUNK_BYTES, CHUNK_BYTES, 5]
    assert b"".join(bytes(d.data) for d in decoded) == source.tobytes()
    stream = SourceChunks(b"L", b"H", 0, source.ctypes.data, nbytes)
    next(stream), next(stream)
    stream.close()
    assert list(stream) == []
