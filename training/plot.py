"""A loss-curve PNG without plotting libraries: a tiny line rasteriser and a PNG encoder (zlib)."""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from os import PathLike

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_BG, _AXIS, _GRID = (255, 255, 255), (40, 40, 40), (225, 225, 225)
SERIES_COLORS = ((31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14))  # blue, red, green, orange


def write_png(path: str | PathLike[str], pixels: list[bytearray], width: int, height: int) -> None:
    """pixels: `height` rows of width * 3 RGB bytes; 8-bit truecolour, filter 0 on every row."""
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(PNG_SIGNATURE + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def plot_curves(path: str | PathLike[str], series: Sequence[Sequence[tuple[float, float]]], *,
                width: int = 640, height: int = 400, log_y: bool = False) -> None:
    """Draws each series of (x, y) points as a polyline (colours: SERIES_COLORS in order) on shared
    axes with a 4 x 4 grid, and writes the PNG. Non-finite points are skipped."""
    pixels = [bytearray(_BG * width) for _ in range(height)]
    margin = 30
    pts = [[(x, math.log(y) if log_y else y) for x, y in s
            if math.isfinite(x) and math.isfinite(y) and (y > 0 or not log_y)] for s in series]
    flat = [p for s in pts for p in s]
    x0, x1 = (min(p[0] for p in flat), max(p[0] for p in flat)) if flat else (0.0, 1.0)
    y0, y1 = (min(p[1] for p in flat), max(p[1] for p in flat)) if flat else (0.0, 1.0)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    left, right, top, bottom = margin, width - margin // 2, margin // 2, height - margin

    def put(x: int, y: int, color: tuple[int, int, int]) -> None:
        if 0 <= x < width and 0 <= y < height:
            pixels[y][3 * x:3 * x + 3] = bytes(color)

    def line(xa: int, ya: int, xb: int, yb: int, color: tuple[int, int, int], thick: int = 1) -> None:
        dx, dy = abs(xb - xa), -abs(yb - ya)  # Bresenham
        sx, sy = (1 if xa < xb else -1), (1 if ya < yb else -1)
        err = dx + dy
        while True:
            for t in range(thick):
                put(xa, ya + t, color)
            if xa == xb and ya == yb:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                xa += sx
            if e2 <= dx:
                err += dx
                ya += sy

    for i in range(5):
        gx = left + (right - left) * i // 4
        gy = top + (bottom - top) * i // 4
        line(gx, top, gx, bottom, _GRID)
        line(left, gy, right, gy, _GRID)
    line(left, bottom, right, bottom, _AXIS)
    line(left, top, left, bottom, _AXIS)

    def to_px(x: float, y: float) -> tuple[int, int]:
        px = left + round((x - x0) / (x1 - x0) * (right - left))
        py = bottom - round((y - y0) / (y1 - y0) * (bottom - top))
        return px, py

    for s, color in zip(pts, SERIES_COLORS * (len(pts) // len(SERIES_COLORS) + 1)):
        prev = None
        for x, y in s:
            cur = to_px(x, y)
            if prev is not None:
                line(*prev, *cur, color, thick=2)
            else:
                put(*cur, color)
            prev = cur
    write_png(path, pixels, width, height)
