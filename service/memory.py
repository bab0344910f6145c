"""Handing freed heap memory back to the operating system.

glibc's malloc keeps what a large tokenization freed (the tokenizer's buffers, its Encoding) in the
arena of the thread that freed it, and reuses it only within that arena: a burst of long prompts
left the parent's RSS ~140 MB higher per worker thread (measured on the bundled tokenizer: 371 MB
after tokenizing 1M characters, 230 MB after `malloc_trim(0)`, which took 10-14 ms). After a long
tokenization the servicer calls `release_free_memory()` on its worker thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import structlog

log = structlog.get_logger(__name__)


def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim  # glibc only (musl has none)
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def release_free_memory() -> bool:
    """Returns free heap pages of every malloc arena to the OS; False where the C library cannot."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
