"""The worker threads the event loop hands long work to: tokenizing long prompts, rendering long
conversations, compiling a structured output's constraint the first time, building large answers
and decoding long lists of ids. Short work stays on the loop, where it costs less than the hop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from pie.engine.config import usable_cores

from .memory import release_free_memory

# After tokenizing a text this long the worker hands freed heap pages back (service/memory.py).
RELEASE_MEMORY_CHARS = 65536

T = TypeVar("T")


class Workers:
    def __init__(self) -> None:
        # One core is left to the event loop: with every core busy tokenizing, the loop waits for a
        # CPU, and health checks and streams stall while long prompts arrive.
        workers = max(1, min(4, usable_cores() - 1))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="servicer-worker")
        # Long tokenizations wait their turn here, on the loop: a burst of long prompts queues
        # coroutines, not executor jobs, so a caller that cancels while it waits costs nothing.
        self._tokenize_slots = asyncio.Semaphore(workers)

    async def run(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` on a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def encode(self, encode: Callable[[], list[int]], chars: int) -> list[int]:
        """A long text's tokenization (`encode()`, of a text of `chars` characters): it waits for a
        free worker on the loop, then runs on it with the GIL released (model.Tokenizer.encode)."""
        async with self._tokenize_slots:
            return await self.run(_encode_and_release, encode, chars >= RELEASE_MEMORY_CHARS)

    def close(self) -> None:
        """Lets the threads go (after the server stopped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _encode_and_release(encode: Callable[[], list[int]], release: bool) -> list[int]:
    """On a worker thread: `encode()`, then (for a long text) the heap pages it freed go back to the
    OS, refused or not (service/memory.py)."""
    try:
        return encode()
    finally:
        if release:
            release_free_memory()
