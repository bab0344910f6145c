"""The grpc.aio server: GenerateService, health (liveness "" and readiness on the service name),
reflection, model loading off the event loop, and graceful drain on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pie.engine.client.engine_client import EngineClient
from pie.engine.client.process import LaunchCancelled, ProcessEngineClient
from pie.engine.client.thread import ThreadEngineClient
from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.errors import StartupError, StepTimeoutError
from pie.model.chat_template import ChatTemplates, NoChatTemplate
from pie.v1 import generate_pb2_grpc

from .admission import Admission
from .auth import BearerTokenInterceptor
from .interceptors import UndecodableRequestInterceptor
from .metrics import ServiceMetrics
from .servicer import SERVICE_NAME, GenerateServicer
from .startup import bind_error, check_startup
from .validation import Limits

if TYPE_CHECKING:
    from .http.serve import HttpServer

log = structlog.get_logger(__name__)


EXIT_ENGINE_DEAD = 3  # process exit status after the engine hung (step watchdog) or its process died
# After the engine died the server answers this long before it stops (readiness already off):
# RPCs in flight send the status they were failed with, and requests arriving meanwhile are refused
# with the engine's cause, the one the log records. Stopping at once, grpc would cancel them
# ("Cancelling all calls") or refuse the connection, and the caller would never see why.
FATAL_GRACE_S = 2.0


@dataclass(slots=True, frozen=True)
class TlsConfig:
    cert: str  # PEM certificate chain of the server
    key: str  # PEM private key of the server
    client_ca: str | None = None  # PEM CA bundle; when set, clients must present a certificate it signed

    def credentials(self) -> grpc.ServerCredentials:
        ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials([(Path(self.key).read_bytes(), Path(self.cert).read_bytes())],
                                           root_certificates=ca, require_client_auth=ca is not None)


@dataclass(frozen=True, slots=True)
class ConnectionConfig:
    """HTTP/2 connection settings for servers behind load balancers (gRPC's keepalive guide and
    its A9 max-connection-age proposal). Seconds; None turns a setting off."""

    keepalive_time_s: float = 60.0  # ping an idle connection this often, so NATs and LBs keep it
    keepalive_timeout_s: float = 20.0  # a ping not answered within this closes the connection
    keepalive_permit_without_calls: bool = True  # ping, and accept clients' pings, without calls in flight
    # Clients may ping this often without data (their own keepalive); more often is answered with
    # GOAWAY "too_many_pings". gRPC's default (5 min) would drop a client whose keepalive is 30 s.
    min_client_ping_interval_s: float = 10.0
    # After this a connection gets GOAWAY: its client reconnects, and a round-robin client picks
    # up replicas added since. In-flight calls finish first (for max_connection_age_grace_s).
    max_connection_age_s: float | None = 1800.0
    max_connection_age_grace_s: float | None = None  # None: calls in flight may take as long as they need
    compression: str = "none"  # responses: "none" or "gzip" (requests are accepted compressed either way)

    def options(self) -> list[tuple[str, int]]:
        def ms(seconds: float) -> int:
            return max(1, round(seconds * 1000))

        opts = [("grpc.keepalive_time_ms", ms(self.keepalive_time_s)),
                ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
                ("grpc.keepalive_permit_without_calls", int(self.keepalive_permit_without_calls)),
                ("grpc.http2.min_ping_interval_without_data_ms", ms(self.min_client_ping_interval_s)),
                ("grpc.http2.max_pings_without_data", 0)]  # our own keepalive pings: no cap between data frames
        if self.max_connection_age_s is not None:
            opts.append(("grpc.max_connection_age_ms", ms(self.max_connection_age_s)))
            if self.max_connection_age_grace_s is not None:
                opts.append(("grpc.max_connection_age_grace_ms", ms(self.max_connection_age_grace_s)))
        return opts

    def compression_algorithm(self) -> grpc.Compression:
        return {"none": grpc.Compression.NoCompression, "gzip": grpc.Compression.Gzip}[self.compression]


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 50051  # 0 = any free port (tests)
    grace_s: float = 30.0  # how long in-flight requests may finish after SIGTERM
    max_message_bytes: int = 16 << 20  # receive/send cap per gRPC message
    model_name: str | None = None  # reported by GetModelInfo; default: the model folder's name
    limits: Limits = field(default_factory=Limits)
    metrics_port: int | None = None  # Prometheus /metrics over HTTP on `host`; None = off, 0 = any free port
    http_port: int | None = None  # the OpenAI-compatible HTTP door (service/http/); None = off, 0 = any free port
    max_concurrent_rpcs: int | None = None  # RPCs in progress at most; beyond it grpc answers RESOURCE_EXHAUSTED
    step_timeout_s: float | None = 60.0  # watchdog: a step longer than this marks the engine hung (None = off)
    tls: TlsConfig | None = None  # None: plaintext (fine on loopback)
    auth_tokens: tuple[str, ...] = ()  # bearer tokens accepted; empty = no token needed
    connection: ConnectionConfig = field(default_factory=ConnectionConfig)
    # Run the engine in a child process (engine/client/process.py) instead of a thread, so the
    # gRPC loop and the engine do not share one GIL (`pie serve` does by default; at 256 streams it
    # serves several times the tokens a thread does, RESULTS.md "Serving"). Off here so that tests start fast.
    engine_process: bool = False
    stream_interval: int = 1  # after the first, a stream message carries at least this many tokens (or the end)
    chat_template: str | None = None  # a Jinja chat template file that replaces the model's own
    # How the HTTP door reads tool calls out of a model's text for tool_choice "auto"
    # (service/http/tool_parsers.py: hermes, llama3_json); None: the text is the answer.
    tool_call_parser: str | None = None
    log_setup: Callable[[], None] | None = None  # configures logging in that child (picklable)
    # Called with the EngineCore once it is built (in the engine process when engine_process, so it
    # must be picklable there: a module-level function): tests and benchmarks swap parts of it.
    engine_setup: Callable[[EngineCore], None] | None = None


class PieServer:
    """Owns the gRPC server and the engine client. `start()` binds and serves at once (NOT_SERVING
    on readiness); `load()` builds the engine off the loop and flips readiness to SERVING."""

    def __init__(self, server_config: ServerConfig, engine_config: EngineConfig) -> None:
        self.config = server_config
        self.engine_config = engine_config
        name = server_config.model_name or Path(engine_config.model).resolve().name
        self.metrics = ServiceMetrics(name, self._engine_stats, num_speculative_tokens=(
            engine_config.num_speculative_tokens if engine_config.speculative else None),
            max_loras=engine_config.max_loras,
            cache_config={"block_size": str(engine_config.block_size), "cache_dtype": engine_config.kv_cache_dtype})
        self.metrics_port: int | None = None  # bound once start() served /metrics
        # The one admission both doors hold (service/admission.py): the engine client, chat
        # templates, limits, in-flight requests and the draining flags live there.
        self.admission = Admission(model_name=name, limits=server_config.limits, metrics=self.metrics,
                                   auth=bool(server_config.auth_tokens))
        self.servicer = GenerateServicer(self.admission, stream_interval=server_config.stream_interval)
        self.http: HttpServer | None = None  # the OpenAI-compatible door, with --http-port only
        if server_config.http_port is not None:  # (FastAPI and uvicorn load only then)
            from .http.app import Door
            from .http.serve import HttpServer

            self.http = HttpServer(Door(self.admission, server_config.auth_tokens, server_config.tool_call_parser))
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.engine_client: EngineClient | None = None  # set when loading begins; serves once load() returns
        self.fatal = asyncio.Event()  # set when the engine died; serve_forever then exits non-zero
        self.load_interrupted = False  # a signal came while loading; a loading thread may still run

    def _engine_stats(self):
        """For the metrics scrape (HTTP thread): None until loaded; waiting includes the hand-off queue."""
        if self.engine_client is None or not self.engine_client.loaded:
            return None
        return self.engine_client.stats()

    async def start(self) -> int:
        """Checks what can be checked before binding (service/startup.py), binds /metrics and the
        gRPC port, and serves (readiness NOT_SERVING until load()). A StartupError (its message
        names the flag or path and the fix) comes before anything is bound or logged as listening."""
        host, tls = self.config.host, self.config.tls
        check_startup(self.engine_config, host=host,
                      ports={"--port": self.config.port, "--metrics-port": self.config.metrics_port,
                             "--http-port": self.config.http_port},
                      tls=None if tls is None else (tls.cert, tls.key, tls.client_ca),
                      chat_template=self.config.chat_template)
        opts = [("grpc.max_receive_message_length", self.config.max_message_bytes),
                ("grpc.max_send_message_length", self.config.max_message_bytes),
                ("grpc.so_reuseport", 0), *self.config.connection.options()]
        interceptors: list[grpc.aio.ServerInterceptor] = [UndecodableRequestInterceptor()]
        if self.config.auth_tokens:
            interceptors.insert(0, BearerTokenInterceptor(self.config.auth_tokens))
        self.server = grpc.aio.server(options=opts, interceptors=interceptors,
                                      maximum_concurrent_rpcs=self.config.max_concurrent_rpcs,
                                      compression=self.config.connection.compression_algorithm())
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        if self.config.metrics_port is not None:  # bound first: a failure here leaves nothing to undo
            try:
                self.metrics_port = self.metrics.serve_http(host, self.config.metrics_port)
            except OSError as e:
                raise bind_error(e, host, self.config.metrics_port, "--metrics-port") from e
        if self.http is not None and self.config.http_port is not None:
            try:
                self.http.bind(host, self.config.http_port)
            except OSError as e:
                self.metrics.stop_http()
                raise bind_error(e, host, self.config.http_port, "--http-port") from e
        address = f"{host}:{self.config.port}"
        try:
            self.port = (self.server.add_secure_port(address, tls.credentials()) if tls is not None
                         else self.server.add_insecure_port(address))
        except RuntimeError:  # gRPC's "Failed to bind": the port was taken since it was checked
            self.port = 0
        if self.port == 0:
            self.metrics.stop_http()
            if self.http is not None:
                await self.http.stop()
            raise StartupError(f"--port {self.config.port}: gRPC could not bind {address}"
                               f"{' with --tls-cert and --tls-key' if tls is not None else ''} (the port is "
                               "in use, or --host is not an address of this machine); pick another port or host")
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)  # liveness
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)  # readiness
        await self.server.start()
        if self.http is not None:
            await self.http.start()
        if self.metrics_port is not None:
            log.info("metrics_listening", host=host, port=self.metrics_port, path="/metrics")
        log.info("server_listening", host=self.config.host, port=self.port, tls=self.config.tls is not None,
                 auth=bool(self.config.auth_tokens))
        return self.port

    async def load(self) -> None:
        """Builds the engine (in its process, or here for a thread) and starts serving. Raises
        LaunchCancelled when stop() came first."""
        loop = asyncio.get_running_loop()

        def on_dead(err: BaseException) -> None:
            loop.call_soon_threadsafe(self._engine_dead, err)

        if self.config.engine_process:
            client: EngineClient = ProcessEngineClient(
                self.engine_config, step_timeout_s=self.config.step_timeout_s, on_dead=on_dead,
                log_setup=self.config.log_setup, engine_setup=self.config.engine_setup)
        else:
            client = ThreadEngineClient(self.engine_config, step_timeout_s=self.config.step_timeout_s, on_dead=on_dead,
                                        engine_setup=self.config.engine_setup)
        self.engine_client = client
        # A daemon thread, not the loop's executor: a stop during a long load must not wait for it.
        await _in_daemon_thread(client.launch, name="engine-launch")
        if self.admission.draining:
            raise LaunchCancelled("the server stopped while the engine was starting")
        client.start(loop)
        self._load_chat_templates()
        self.admission.engine_client = client
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        log.info("server_ready", model=self.admission.model_name)

    def _load_chat_templates(self) -> None:
        """The model's chat templates (or --chat-template's) for chat requests; without a usable
        one, chat requests are refused with the reason (NO_CHAT_TEMPLATE)."""
        try:
            self.admission.chat_templates = ChatTemplates.load(self.engine_config.model, self.config.chat_template)
        except (NoChatTemplate, OSError, ValueError) as e:
            self.admission.chat_templates = None
            self.admission.chat_template_problem = str(e)
            return
        log.info("chat_template_loaded", origin=self.admission.chat_templates.origin,
                 templates=sorted(self.admission.chat_templates.templates))

    def _engine_dead(self, err: BaseException) -> None:
        """On the loop, as the engine is declared dead (its RPCs fail next): readiness off, then exit."""
        log.error("server_engine_dead", error=str(err), hung=isinstance(err, StepTimeoutError))
        asyncio.ensure_future(self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING))
        self.fatal.set()

    async def stop(self, grace_s: float | None = None) -> None:
        """Readiness off, new requests UNAVAILABLE, in-flight requests get `grace_s` to finish."""
        grace = self.config.grace_s if grace_s is None else grace_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        self.admission.draining = True
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        in_flight = self.engine_client.num_in_flight if self.engine_client is not None else 0
        log.info("server_draining", grace_s=grace, in_flight=in_flight)
        if self.engine_client is not None and in_flight:
            # Health and the RPCs' UNAVAILABLE answers keep working while in-flight requests finish.
            try:
                await asyncio.wait_for(self.engine_client.wait_idle(), timeout=grace)
            except TimeoutError:
                log.warning("drain_timeout", still_in_flight=self.engine_client.num_in_flight)
        if self.server is not None:
            self.admission.shutting_down = True  # what gRPC cancels from here on, the shutdown cut
            await self.server.stop(max(0.0, deadline - loop.time()))
        if self.http is not None:
            await self.http.stop()
        if self.engine_client is not None:
            await asyncio.to_thread(self.engine_client.stop)
        self.admission.close()
        self.metrics.stop_http()
        log.info("server_stopped")

    async def serve_forever(self) -> int:
        """Serves until SIGTERM/SIGINT (returns 0 after draining) or an engine that died (returns
        EXIT_ENGINE_DEAD at once: the RPCs were failed already, a supervisor should restart us).
        A signal during loading stops at once: the engine process is killed, and a model loading
        on a thread is left to the process exit (`self.load_interrupted`)."""
        await self.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loader = asyncio.create_task(self.load())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait([loader, stopped], return_when=asyncio.FIRST_COMPLETED)
        if not loader.done():
            log.info("server_stopping_while_loading")
            self.load_interrupted = True
            await self.stop(0)
            loader.cancel()
            return 0
        error = loader.exception()
        if error is not None:
            await self.stop(0)
            raise error
        await asyncio.wait([stopped, asyncio.create_task(self.fatal.wait())], return_when=asyncio.FIRST_COMPLETED)
        if self.fatal.is_set():
            await asyncio.sleep(min(self.config.grace_s, FATAL_GRACE_S))
            await self.stop(0)
            return EXIT_ENGINE_DEAD
        await self.stop()
        return 0


async def _in_daemon_thread(fn: Callable[[], None], *, name: str) -> None:
    """Runs fn on a daemon thread of its own and waits for it without blocking the loop."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if done.done():
            return
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    def run() -> None:
        try:
            fn()
        except BaseException as e:
            error: BaseException | None = e
        else:
            error = None
        if not loop.is_closed():
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    await done


class BackgroundServer:
    """A PieServer on its own event loop thread: for tests and embedding. `with BackgroundServer(...)
    as s:` binds, loads the model and serves on `s.address` until the block ends."""

    def __init__(self, server_config: ServerConfig, engine_config: EngineConfig) -> None:
        self.pie = PieServer(server_config, engine_config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpc-loop", daemon=True)
        self.address: str | None = None
        self.http_url: str | None = None

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> BackgroundServer:
        self._thread.start()
        port = self._call(self.pie.start(), 60)
        self.address = f"{self.pie.config.host}:{port}"
        if self.pie.http is not None and self.pie.http.port is not None:
            self.http_url = f"http://{self.pie.config.host}:{self.pie.http.port}"  # the HTTP door's
        self._call(self.pie.load(), 600)
        return self

    def stop(self, grace_s: float = 5.0) -> None:
        self._call(self.pie.stop(grace_s), grace_s + 60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def core(self) -> EngineCore:
        """The engine core itself, when it runs on a thread of this process (tests reach in)."""
        client = self.pie.engine_client
        if not isinstance(client, ThreadEngineClient) or client.core is None:
            raise AttributeError("the engine core runs in another process (or is not loaded)")
        return client.core
