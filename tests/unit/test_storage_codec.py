"""The L3 value codec (hicache/storage/codec.py) and the framing each backend puts around it:
round trips, every rejection, and the byte formats pinned (files and keys already stored must
still read)."""

from __future__ import annotations

import io
import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.storage import codec
from hicache.storage.base import ObjectContent
from hicache.storage.codec import Corrupt
from hicache.storage.file import format as file_format
from hicache.storage.redis import format as redis_format

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.uint8, torch.int64]


def stored(value: torch.Tensor | bytes) -> tuple[codec.Encoded, bytes]:
    """The encoding of ``value`` and its payload as a backend reads it back (its own bytes)."""
    enc = codec.encode(value)
    return enc, bytes(enc.payload)


# ---- codec -------------------------------------------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=4),
    seed=st.integers(0, 1000),
)
def test_tensor_round_trip(dtype, shape, seed):
    t = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 50).to(dtype)
    enc, data = stored(t)
    assert enc.is_tensor and enc.dtype == str(dtype).removeprefix("torch.")
    assert enc.shape == tuple(shape) and enc.payload.nbytes == t.numel() * t.element_size()
    back = codec.decode(True, enc.dtype, enc.shape, data, len(data), codec.checksum(enc.payload))
    assert isinstance(back, torch.Tensor)
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


@pytest.mark.parametrize("value", [b"abc", bytearray(b"xyz!"), memoryview(b"0123"), b""])
def test_bytes_round_trip(value):
    enc, data = stored(value)
    assert not enc.is_tensor and enc.dtype == "uint8" and enc.shape == (len(value),)
    back = codec.decode(False, enc.dtype, enc.shape, data, len(data), codec.checksum(data))
    assert back == bytes(value)


def test_encode_views_a_contiguous_tensor_and_copies_a_strided_one():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    enc = codec.encode(t)
    t[0, 0] = 99.0  # the payload is a view: it sees the change
    assert struct.unpack_from("<f", enc.payload)[0] == 99.0
    strided = codec.encode(t.t())
    assert strided.shape == (4, 3)
    assert bytes(strided.payload) == t.t().contiguous().numpy().tobytes()


def test_encode_refuses_what_it_cannot_store():
    with pytest.raises(TypeError, match="cannot store a list"):
        codec.encode([1, 2, 3])  # type: ignore[arg-type]


def test_checksum_is_xxh3_64():
    assert codec.checksum(b"abc") == 8696274497037089104
    assert codec.checksum(memoryview(b"abc")) == codec.checksum(b"abc")


def test_truncated_payload_is_corrupt():
    enc, data = stored(torch.arange(8, dtype=torch.float32))
    with pytest.raises(Corrupt, match="28 payload bytes, metadata says 32"):
        codec.decode(True, enc.dtype, enc.shape, data[:-4], 32, codec.checksum(data))


def test_bad_checksum_is_corrupt():
    enc, data = stored(torch.arange(8, dtype=torch.float32))
    damaged = bytes([data[0] ^ 1]) + data[1:]
    with pytest.raises(Corrupt, match="checksum mismatch"):
        codec.decode(True, enc.dtype, enc.shape, damaged, len(data), codec.checksum(data))
    with pytest.raises(Corrupt, match="checksum mismatch"):
        codec.decode(False, "uint8", (3,), b"abd", 3, codec.checksum(b"abc"))


def test_unknown_dtype_is_corrupt():
    enc, data = stored(torch.arange(8, dtype=torch.float32))
    for name in ("float99", "Tensor", "nn"):  # not a dtype, or a torch attribute that is not
        with pytest.raises(Corrupt, match=f"unknown dtype {name}"):
            codec.decode(True, name, enc.shape, data, len(data), codec.checksum(data))


@pytest.mark.parametrize(
    "dtype,shape",
    [("float32", (3, 3)), ("float32", (7,)), ("float16", (8,)), ("int64", (8,)), ("float32", (0,))],
)
def test_shape_and_dtype_that_disagree_with_the_length_are_corrupt(dtype, shape):
    _, data = stored(torch.arange(8, dtype=torch.float32))  # 32 bytes
    with pytest.raises(Corrupt, match="shape and length disagree"):
        codec.decode(True, dtype, shape, data, len(data), codec.checksum(data))
    with pytest.raises(Corrupt, match="shape and length disagree"):
        codec.tensor_dtype(dtype, shape, len(data))


def test_tensor_dtype_of_a_matching_layout():
    assert codec.tensor_dtype("bfloat16", (2, 3), 12) is torch.bfloat16
    assert codec.tensor_dtype("float32", (0, 5), 0) is torch.float32


def test_empty_tensor_round_trips():
    t = torch.empty(0, 4, dtype=torch.float16)
    enc, data = stored(t)
    back = codec.decode(True, enc.dtype, enc.shape, data, 0, codec.checksum(data))
    assert isinstance(back, torch.Tensor) and back.shape == (0, 4) and back.dtype == torch.float16


# ---- the file backend's framing ------------------------------------------------------------------
T = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
# written by the format's VERSION 4 (pinned): with content (a namespace and two tokens), with
# the shared namespace, without content
FILE_V4_TENSOR = bytes.fromhex(
    "48434b560400020004000000030000000c00000000000000c389a7a5381e7d4b62666c6f6174313600000000"
    "0000000004000000020000006b6579307061720200000000000000030000000000000061636d650500000006"
    "0000000000803f004040408040a040"
)
FILE_V4_BYTES = bytes.fromhex(
    "48434b560400010102000000ffffffff030000000000000050392f89945faf7875696e743800000000000000"
    "00000000ffffffff010000006b31030000000000000007000000616263"
)
FILE_V4_NO_CONTENT = bytes.fromhex(
    "48434b560400010102000000ffffffff030000000000000050392f89945faf7875696e743800000000000000"
    "00000000ffffffffffffffff6b310300000000000000616263"
)
# written by the format's VERSION 3 (pinned: files already on disk must still read)
FILE_V3_TENSOR = bytes.fromhex(
    "48434b560300020004000000030000000c00000000000000c389a7a5381e7d4b62666c6f6174313600000000"
    "000000006b657930706172020000000000000003000000000000000000803f004040408040a040"
)
FILE_V3_BYTES = bytes.fromhex(
    "48434b560300010102000000ffffffff030000000000000050392f89945faf7875696e743800000000000000"
    "000000006b310300000000000000616263"
)


def test_file_format_is_unchanged():
    head, payload = file_format.encode_object("key0", T, "par", ObjectContent.of("acme", [5, 6]))
    assert head + bytes(payload) == FILE_V4_TENSOR
    head, payload = file_format.encode_object("k1", b"abc", None, ObjectContent.of(None, [7]))
    assert head + bytes(payload) == FILE_V4_BYTES
    head, payload = file_format.encode_object("k1", b"abc", None)
    assert head + bytes(payload) == FILE_V4_NO_CONTENT


def test_file_header_reads_back():
    h = file_format.read_header(io.BytesIO(FILE_V4_TENSOR))
    assert (h.key, h.parent, h.kind, h.dtype, h.shape, h.payload_len, h.version) == (
        "key0",
        "par",
        0,
        "bfloat16",
        (2, 3),
        12,
        4,
    )
    assert h.content == ObjectContent.of("acme", [5, 6]) and h.content.token_ids() == [5, 6]
    assert h.matches(FILE_V4_TENSOR[h.header_len :])
    assert not h.matches(FILE_V4_TENSOR[h.header_len : -1] + b"\0")
    h = file_format.read_header(io.BytesIO(FILE_V4_BYTES))
    assert (h.key, h.parent, h.kind, h.shape, h.content) == (
        "k1",
        None,
        1,
        (3,),
        ObjectContent(None, bytes([7, 0, 0, 0])),
    )
    h = file_format.read_header(io.BytesIO(FILE_V4_NO_CONTENT))
    assert (h.key, h.shape, h.content) == ("k1", (3,), None)


def test_version3_file_header_reads_as_before():
    """Files written before the content (VERSION 3) read as before, their content unknown."""
    h = file_format.read_header(io.BytesIO(FILE_V3_TENSOR))
    assert (h.key, h.parent, h.kind, h.dtype, h.shape, h.payload_len, h.version) == (
        "key0",
        "par",
        0,
        "bfloat16",
        (2, 3),
        12,
        3,
    )
    assert h.content is None
    assert h.matches(FILE_V3_TENSOR[h.header_len :])
    assert not h.matches(FILE_V3_TENSOR[h.header_len : -1] + b"\0")
    h = file_format.read_header(io.BytesIO(FILE_V3_BYTES))
    assert (h.key, h.parent, h.kind, h.shape, h.content) == ("k1", None, 1, (3,), None)


@pytest.mark.parametrize("version", [0, 1, 5, 0xFFFF])
def test_file_of_another_version_is_corrupt(version):
    raw = FILE_V3_TENSOR[:4] + struct.pack("<H", version) + FILE_V3_TENSOR[6:]
    with pytest.raises(Corrupt, match=f"version {version}"):
        file_format.read_header(io.BytesIO(raw))


def test_file_with_a_bad_magic_is_corrupt():
    with pytest.raises(Corrupt, match="magic"):
        file_format.read_header(io.BytesIO(b"XXXX" + FILE_V3_TENSOR[4:]))


@pytest.mark.parametrize("cut", [0, 3, 6, 20, 47, 50])
@pytest.mark.parametrize("raw", [FILE_V3_TENSOR, FILE_V4_TENSOR], ids=["v3", "v4"])
def test_truncated_file_header_is_corrupt(cut, raw):
    with pytest.raises(Corrupt, match="short header"):
        file_format.read_header(io.BytesIO(raw[:cut]))


def test_truncated_file_content_is_corrupt():
    h = file_format.read_header(io.BytesIO(FILE_V4_TENSOR))
    with pytest.raises(Corrupt, match="short header"):
        file_format.read_header(io.BytesIO(FILE_V4_TENSOR[: h.header_len - 1]))


def test_file_content_beyond_the_limits_is_corrupt():
    at = file_format.FIXED.size - 4  # token_count
    raw = FILE_V4_TENSOR[:at] + struct.pack("<I", 1 << 30) + FILE_V4_TENSOR[at + 4 :]
    with pytest.raises(Corrupt, match="bad header fields"):
        file_format.read_header(io.BytesIO(raw))


# ---- the redis backend's framing -----------------------------------------------------------------
REDIS_META_TENSOR = (
    b'{"v":2,"n":12,"k":"t","dt":"bfloat16","sh":[2,3],"h":5439537153579649475,"p":"par"}'
)
REDIS_META_BYTES = b'{"v":2,"n":3,"k":"b","dt":"uint8","sh":[3],"h":8696274497037089104,"p":null}'


def test_redis_format_is_unchanged():
    obj = redis_format.Object(codec.encode(T), "par")
    assert obj.meta() == REDIS_META_TENSOR
    assert bytes(obj.payload) == bytes.fromhex("0000803f004040408040a040")
    assert redis_format.Object(codec.encode(b"abc"), None).meta() == REDIS_META_BYTES


def test_redis_metadata_reads_back():
    meta = redis_format.Meta.decode(REDIS_META_TENSOR)
    back = meta.value(bytes.fromhex("0000803f004040408040a040"))
    assert isinstance(back, torch.Tensor) and torch.equal(back, T) and meta.parent == "par"
    assert redis_format.Meta.decode(REDIS_META_BYTES).value(b"abc") == b"abc"
    with pytest.raises(Corrupt, match="checksum mismatch"):
        redis_format.Meta.decode(REDIS_META_BYTES).value(b"abd")


@pytest.mark.parametrize("change", [{"v": 1}, {"v": 3}, {"k": "x"}])
def test_redis_metadata_of_another_version_or_kind_is_corrupt(change):
    d = json.loads(REDIS_META_TENSOR) | change
    with pytest.raises(Corrupt, match="metadata version"):
        redis_format.Meta.decode(json.dumps(d).encode())


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"[]",
        b'{"v":2}',
        REDIS_META_TENSOR[:-10],
        b'{"v":2,"n":"x","k":"t","dt":"f","sh":[],"h":0,"p":null}',
    ],
)
def test_unparsable_redis_metadata_is_corrupt(raw):
    with pytest.raises(Corrupt, match="unparsable metadata"):
        redis_format.Meta.decode(raw)
