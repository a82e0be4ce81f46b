"""Heatmap PNGs (moe/pictures.py): a valid PNG whose pixels are the viridis colours of the cells."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from prism_megatron.moe.pictures import heatmap_png, read_png_size


def _pixels(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, size = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body)
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    w, h = size
    raw = zlib.decompress(idat)
    rows = [raw[y * (3 * w + 1) + 1:(y + 1) * (3 * w + 1)] for y in range(h)]
    return np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(h, w, 3)


def test_cells_are_coloured_from_minimum_dark_to_maximum_yellow(tmp_path):
    path = str(tmp_path / "h.png")
    heatmap_png(path, np.array([[0, 5], [10, 2]]), cell=4)
    assert read_png_size(path) == (8, 8)
    px = _pixels(path)
    assert px[0, 0].tolist() == [68, 1, 84]        # the minimum: viridis' dark end
    assert px[4, 0].tolist() == [253, 231, 37]     # the maximum: its yellow end
    assert (px[0:4, 0:4] == px[0, 0]).all()        # a cell is a 4x4 block
    assert px[0, 4].tolist() == [33, 145, 140]     # halfway: viridis' middle


def test_empty_matrix_is_refused(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        heatmap_png(str(tmp_path / "e.png"), np.zeros((0, 3)))
