"""Shared test helper: compare zip archives apart from their DOS timestamps."""

import struct


def zero_timestamps(data: bytes) -> bytes:
    """``data`` with the DOS time/date of every local header (bytes 10..13) and
    central record (bytes 12..15) zeroed."""
    b = bytearray(data)
    eocd = b.rfind(b"PK\x05\x06")
    assert eocd >= 0, "no end of central directory record"
    count = struct.unpack_from("<H", b, eocd + 10)[0]
    cd_off = struct.unpack_from("<I", b, eocd + 16)[0]
    if count == 0xFFFF or cd_off == 0xFFFFFFFF:
        z64 = b.rfind(b"PK\x06\x06")
        assert z64 >= 0
        count = struct.unpack_from("<Q", b, z64 + 32)[0]
        cd_off = struct.unpack_from("<Q", b, z64 + 48)[0]
    p = cd_off
    for _ in range(count):
        assert b[p : p + 4] == b"PK\x01\x02", f"bad central record at {p}"
        b[p + 12 : p + 16] = bytes(4)
        csize, usize = struct.unpack_from("<II", b, p + 20)
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", b, p + 28)
        local = struct.unpack_from("<I", b, p + 42)[0]
        if local == 0xFFFFFFFF:
            q, end = p + 46 + name_len, p + 46 + name_len + extra_len
            while q < end:
                hid, hlen = struct.unpack_from("<HH", b, q)
                if hid == 1:
                    k = q + 4 + (8 if usize == 0xFFFFFFFF else 0) + (8 if csize == 0xFFFFFFFF else 0)
                    local = struct.unpack_from("<Q", b, k)[0]
                q += 4 + hlen
        assert b[local : local + 4] == b"PK\x03\x04", f"bad local header at {local}"
        b[local + 10 : local + 14] = bytes(4)
        p += 46 + name_len + extra_len + comment_len
    return bytes(b)
