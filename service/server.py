"""The grpc.aio server: GenerateService, health (liveness "" and readiness on the service name),
reflection, model loading off the event loop, and graceful drain on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.engine_thread import AsyncEngine
from pie.v1 import generate_pb2, generate_pb2_grpc
from service.servicer import SERVICE_NAME, GenerateServicer
from service.validation import Limits

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 50051  # 0 = any free port (tests)
    grace_s: float = 30.0  # how long in-flight requests may finish after SIGTERM
    max_message_bytes: int = 16 << 20  # receive/send cap per gRPC message
    model_name: str | None = None  # reported by GetModelInfo; default: the model folder's name
    limits: Limits = field(default_factory=Limits)


class PieServer:
    """Owns the gRPC server and the engine thread. `start()` binds and serves at once (NOT_SERVING
    on readiness); `load()` builds the engine off the loop and flips readiness to SERVING."""

    def __init__(self, server_config: ServerConfig, engine_config: EngineConfig) -> None:
        self.config = server_config
        self.engine_config = engine_config
        name = server_config.model_name or Path(engine_config.model).resolve().name
        self.servicer = GenerateServicer(model_name=name, limits=server_config.limits)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.engine: AsyncEngine | None = None

    async def start(self) -> int:
        opts = [("grpc.max_receive_message_length", self.config.max_message_bytes),
                ("grpc.max_send_message_length", self.config.max_message_bytes),
                ("grpc.so_reuseport", 0)]
        self.server = grpc.aio.server(options=opts)
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        self.port = self.server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        if self.port == 0:
            raise RuntimeError(f"could not bind {self.config.host}:{self.config.port}")
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)  # liveness
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)  # readiness
        await self.server.start()
        log.info("server_listening", host=self.config.host, port=self.port)
        return self.port

    async def load(self) -> None:
        core = await asyncio.to_thread(LLMEngine, self.engine_config)
        self.engine = AsyncEngine(core)
        self.engine.start(asyncio.get_running_loop())
        self.servicer.engine = self.engine
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        log.info("server_ready", model=self.servicer.model_name)

    async def stop(self, grace_s: float | None = None) -> None:
        """Readiness off, new requests UNAVAILABLE, in-flight requests get `grace_s` to finish."""
        grace = self.config.grace_s if grace_s is None else grace_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        self.servicer.draining = True
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        in_flight = self.engine.num_in_flight if self.engine is not None else 0
        log.info("server_draining", grace_s=grace, in_flight=in_flight)
        if self.engine is not None and in_flight:
            # Health and the RPCs' UNAVAILABLE answers keep working while in-flight requests finish.
            try:
                await asyncio.wait_for(self.engine.wait_idle(), timeout=grace)
            except TimeoutError:
                log.warning("drain_timeout", still_in_flight=self.engine.num_in_flight)
        if self.server is not None:
            await self.server.stop(max(0.0, deadline - loop.time()))
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
        log.info("server_stopped")

    async def serve_forever(self) -> None:
        await self.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loader = asyncio.create_task(self.load())
        await asyncio.wait([loader, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if loader.done() and loader.exception() is not None:
            await self.stop(0)
            raise loader.exception()
        await stop.wait()
        loader.cancel()
        await self.stop()


class BackgroundServer:
    """A PieServer on its own event loop thread: for tests and embedding. `with BackgroundServer(...)
    as s:` binds, loads the model and serves on `s.address` until the block ends."""

    def __init__(self, server_config: ServerConfig, engine_config: EngineConfig) -> None:
        self.pie = PieServer(server_config, engine_config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpc-loop", daemon=True)
        self.address: str | None = None

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> "BackgroundServer":
        self._thread.start()
        port = self._call(self.pie.start(), 60)
        self.address = f"{self.pie.config.host}:{port}"
        self._call(self.pie.load(), 600)
        return self

    def stop(self, grace_s: float = 5.0) -> None:
        self._call(self.pie.stop(grace_s), grace_s + 60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def engine(self) -> LLMEngine:
        return self.pie.engine.engine
