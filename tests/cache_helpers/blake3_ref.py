"""BLAKE3 (hash mode, 32-byte output) in plain Python, after the reference implementation.

Only for tests that forge well-formed cache entries (the header checksum is blake3 over key,
metadata length, metadata and payload); slow (about 1 MB/s), fine for entries of a few KB. The
tests check it against the known vectors below and against a checksum tpuc itself wrote.
"""

from __future__ import annotations

import struct

_IV = (0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19)
_PERM = (2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8)
_CHUNK_START, _CHUNK_END, _PARENT, _ROOT = 1, 2, 4, 8
_BLOCK, _CHUNK = 64, 1024
_M = 0xFFFFFFFF

# Known answers (from the BLAKE3 specification's test vectors).
VECTORS = {
    b"": "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262",
    b"abc": "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85",
}


def _g(s, a, b, c, d, x, y):
    s[a] = (s[a] + s[b] + x) & _M
    v = s[d] ^ s[a]
    s[d] = ((v >> 16) | (v << 16)) & _M
    s[c] = (s[c] + s[d]) & _M
    v = s[b] ^ s[c]
    s[b] = ((v >> 12) | (v << 20)) & _M
    s[a] = (s[a] + s[b] + y) & _M
    v = s[d] ^ s[a]
    s[d] = ((v >> 8) | (v << 24)) & _M
    s[c] = (s[c] + s[d]) & _M
    v = s[b] ^ s[c]
    s[b] = ((v >> 7) | (v << 25)) & _M


def _compress(cv, block: bytes, counter: int, block_len: int, flags: int) -> list[int]:
    m = list(struct.unpack("<16I", block.ljust(_BLOCK, b"\0")))
    s = list(cv) + list(_IV[:4]) + [counter & _M, (counter >> 32) & _M, block_len, flags]
    for r in range(7):
        _g(s, 0, 4, 8, 12, m[0], m[1])
        _g(s, 1, 5, 9, 13, m[2], m[3])
        _g(s, 2, 6, 10, 14, m[4], m[5])
        _g(s, 3, 7, 11, 15, m[6], m[7])
        _g(s, 0, 5, 10, 15, m[8], m[9])
        _g(s, 1, 6, 11, 12, m[10], m[11])
        _g(s, 2, 7, 8, 13, m[12], m[13])
        _g(s, 3, 4, 9, 14, m[14], m[15])
        if r < 6:
            m = [m[i] for i in _PERM]
    return [s[i] ^ s[i + 8] for i in range(8)] + [s[i + 8] ^ cv[i] for i in range(8)]


def _chunk_output(chunk: bytes, counter: int):
    """(cv, block, counter, block_len, flags) of the chunk's last block, not yet compressed."""
    cv = list(_IV)
    blocks = [chunk[i : i + _BLOCK] for i in range(0, len(chunk), _BLOCK)] or [b""]
    for i, block in enumerate(blocks):
        flags = (_CHUNK_START if i == 0 else 0) | (_CHUNK_END if i == len(blocks) - 1 else 0)
        if i == len(blocks) - 1:
            return (cv, block, counter, len(block), flags)
        cv = _compress(cv, block, counter, _BLOCK, flags)[:8]
    raise AssertionError("unreachable")


def _parent_output(left: list[int], right: list[int]):
    return (list(_IV), struct.pack("<16I", *left, *right), 0, _BLOCK, _PARENT)


def _cv(output) -> list[int]:
    return _compress(*output)[:8]


def blake3(data: bytes) -> bytes:
    """The 32-byte BLAKE3 hash of `data`."""
    chunks = [data[i : i + _CHUNK] for i in range(0, len(data), _CHUNK)] or [b""]
    stack: list[list[int]] = []
    for n, chunk in enumerate(chunks[:-1]):
        cv = _cv(_chunk_output(chunk, n))
        total = n + 1
        while total & 1 == 0:
            cv = _cv(_parent_output(stack.pop(), cv))
            total >>= 1
        stack.append(cv)
    output = _chunk_output(chunks[-1], len(chunks) - 1)
    while stack:
        output = _parent_output(stack.pop(), _cv(output))
    cv, block, counter, block_len, flags = output
    return struct.pack("<8I", *_compress(cv, block, counter, block_len, flags | _ROOT)[:8])
