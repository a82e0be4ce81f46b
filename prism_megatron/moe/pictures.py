"""Heatmap PNGs for MoE load and per-rank memory (and any RGB image), written without a plotting library.

`heatmap_png(path, values)` draws a matrix as cells (rows top to bottom, columns left to right) in
the viridis colour scale (dark blue = the matrix's minimum, yellow = its maximum), each cell `cell`
pixels square, and writes an 8-bit RGB PNG (zlib, CRC) atomically. The pictures carry no text: the
table printed and written beside them gives the numbers and the axes.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

# viridis at 0, 0.25, 0.5, 0.75, 1 (matplotlib's published values, rounded)
_ANCHORS = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]],
                    dtype=np.float64)


def colours(values: np.ndarray) -> np.ndarray:
    """uint8 RGB for `values` scaled from their minimum to their maximum."""
    v = np.asarray(values, dtype=np.float64)
    lo, hi = float(v.min()), float(v.max())
    t = np.zeros_like(v) if hi <= lo else (v - lo) / (hi - lo)
    pos = t * (len(_ANCHORS) - 1)
    i = np.minimum(pos.astype(int), len(_ANCHORS) - 2)
    frac = (pos - i)[..., None]
    return np.round(_ANCHORS[i] * (1 - frac) + _ANCHORS[i + 1] * frac).astype(np.uint8)


def heatmap_png(path: str, values: np.ndarray, cell: int = 12) -> None:
    """Write `values` (2-D) as a heatmap PNG at `path`, atomically."""
    v = np.atleast_2d(np.asarray(values))
    if v.size == 0:
        raise ValueError("an empty matrix has no picture")
    write_rgb_png(path, colours(v).repeat(cell, axis=0).repeat(cell, axis=1))


def write_rgb_png(path: str, rgb: np.ndarray) -> None:
    """Write an [height, width, 3] uint8 image as an RGB PNG at `path`, atomically."""
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    height, width = rgb.shape[:2]
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(height))  # filter 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
    from prism_megatron.util import atomic_write_bytes

    atomic_write_bytes(path, png)


def read_png_size(path: str) -> tuple[int, int]:
    """(width, height) from a PNG's header."""
    with open(path, "rb") as handle:
        head = handle.read(24)
    if head[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG")
    return struct.unpack(">II", head[16:24])
