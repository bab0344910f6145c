"""The HTTP door's server: uvicorn on the gRPC server's own event loop (the engine client delivers
outputs on that loop), bound before anything is announced, stopped after the gRPC drain.
Signals stay the PieServer's: SIGTERM drains both doors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import structlog
import uvicorn

from .app import Door, build_app

log = structlog.get_logger(__name__)


class _OnOurLoop(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the PieServer handles SIGTERM and SIGINT (its drain)
        yield


class HttpServer:
    def __init__(self, door: Door) -> None:
        self.door = door
        self._server: _OnOurLoop | None = None
        self._task: asyncio.Task | None = None
        self.port: int | None = None

    def bind(self, host: str, port: int) -> int:
        """Binds the port now (OSError when it cannot); serving starts with `start`."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP named: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say they are
        # TCP, and with it on, a stream's first event waits for the client's delayed ACK (~40 ms).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self.port = sock.getsockname()[1]
        return self.port

    async def start(self) -> None:
        config = uvicorn.Config(build_app(self.door), log_config=None, log_level=logging.WARNING, access_log=False,
                                lifespan="off", timeout_graceful_shutdown=5)
        self._server = _OnOurLoop(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()  # uvicorn failed to start: its error
        log.info("http_listening", port=self.port, docs="/docs", playground="/")

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            if getattr(self, "_sock", None) is not None:
                self._sock.close()
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
