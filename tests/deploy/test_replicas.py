"""Two `pie serve` replicas behind nginx (deploy/nginx/pie.conf.template, rendered and started by
deploy/README.md's own commands): gRPC and HTTP calls are balanced per call, and when one replica
is killed (SIGKILL) under load every request still ends with its answer, each call within its
deadline.

The failover figures are printed (`pytest -s` shows them)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from grpc_health.v1 import health_pb2

import pie_client
from tests.deploy.deploy_readme import command, run
from tests.helpers import wait_until
from tests.service.processes import ServerProcess, readiness

pytestmark = pytest.mark.slow

REQUESTS = 300  # requests in the load: a third unary Generate, a third GenerateStream, a third HTTP
KINDS = ("unary", "stream", "http")  # request i is of kind KINDS[i % 3]; "http": a /v1/completions
CONCURRENCY = 6  # requests in flight at once
KILL_AFTER = REQUESTS // 3  # requests finished when the first replica is killed
MAX_TOKENS = 24
DEADLINE_S = 60.0  # every call's deadline
ATTEMPTS = 3  # a request the caller sees fail is sent again, this many times in all at most
# Small CPU replicas: one torch thread each (two replicas share the machine with nginx and the load).
REPLICA_ARGS = ["--device", "cpu", "--port", "0", "--http-port", "0", "--cpu-threads", "1",
                "--num-kv-blocks", "256", "--max-num-seqs", "16", "--grace", "1"]


@pytest.fixture(scope="module", autouse=True)
def _tools() -> None:
    """nginx and envsubst, before any replica starts: the tests skip without them, except in CI,
    where their absence fails the tests."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    missing = [name for name in ("nginx", "envsubst") if shutil.which(name, path=path) is None]
    if missing:
        message = f"{' and '.join(missing)} not installed (Debian: apt-get install -y nginx-light gettext-base)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Replica:
    server: ServerProcess
    address: str  # its gRPC address
    http_address: str

    def served(self, request_ids: set[str]) -> set[str]:
        """Which of `request_ids` this replica finished OK (its request_done log lines)."""
        return {e["request_id"] for e in list(self.server.events)
                if e.get("event") == "request_done" and e.get("status") == "OK" and e.get("request_id") in request_ids}


def _port(server: ServerProcess, event: str) -> int:
    """The port in the replica's first `event` log line (its listeners log "server_listening" and
    "http_listening")."""
    def logged() -> dict | None:
        assert server.proc.poll() is None, f"the replica exited ({server.proc.returncode}): {server.events[-5:]}"
        return server.event(event)
    return wait_until(logged, timeout=120, what=f"a replica's {event}")["port"]


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[Replica]]:
    servers = [ServerProcess(REPLICA_ARGS) for _ in range(2)]  # they load side by side
    try:
        out = [Replica(server, f"127.0.0.1:{_port(server, 'server_listening')}",
                       f"127.0.0.1:{_port(server, 'http_listening')}") for server in servers]
        for replica in out:
            wait_until(lambda r=replica: readiness(r.address) == health_pb2.HealthCheckResponse.SERVING,
                       timeout=180, what=f"replica {replica.address} ready")
        yield out
    finally:
        for server in servers:
            server.finish()


@dataclass
class Nginx:
    env: dict[str, str]  # the README's $PIE_... variables
    folder: Path

    @property
    def grpc_address(self) -> str:
        return self.env["PIE_GRPC_LISTEN"]

    @property
    def http_url(self) -> str:
        return f"http://{self.env['PIE_HTTP_LISTEN']}"

    def access_log(self) -> list[str]:
        return (self.folder / "access.log").read_text().splitlines()


@contextlib.contextmanager
def _nginx(grpc_upstreams: list[str], http_upstreams: list[str]) -> Iterator[Nginx]:
    """nginx rendered and started by deploy/README.md's commands, stopped by its stop command."""
    # Outside pytest's own tmp folders (mode 0700): nginx's workers, which run as another user when
    # it is started as root, must reach their temp folders under the prefix.
    folder = Path(tempfile.mkdtemp(prefix="pie-nginx-"))
    folder.chmod(0o755)
    env = {
        "PIE_NGINX_DIR": str(folder),
        "PIE_GRPC_LISTEN": f"127.0.0.1:{_free_port()}",
        "PIE_HTTP_LISTEN": f"127.0.0.1:{_free_port()}",
        "PIE_REPLICA_1_GRPC": grpc_upstreams[0],
        "PIE_REPLICA_2_GRPC": grpc_upstreams[1],
        "PIE_REPLICA_1_HTTP": http_upstreams[0],
        "PIE_REPLICA_2_HTTP": http_upstreams[1],
    }
    try:
        for prefix in ('mkdir -p "$PIE_NGINX_DIR"', "envsubst ", "nginx -t "):
            done = run(command(prefix), env)
            assert done.returncode == 0, (prefix, done.stderr)
        conf = (folder / "pie.conf").read_text()
        assert not re.search(r"\$\{PIE_\w+\}", conf), "a variable envsubst left"
        assert grpc_upstreams[0] in conf and "$proxy_add_x_forwarded_for" in conf  # nginx's own are kept
        started = run(command("nginx -p ", "-e stderr"), env)  # it daemonizes once its ports are bound
        assert started.returncode == 0, started.stderr
        pid = int((folder / "nginx.pid").read_text())
        try:
            yield Nginx(env, folder)
        finally:
            stopped = run(command("nginx -p ", "-s stop"), env)
            if stopped.returncode != 0 or not _gone(pid):
                os.kill(pid, signal.SIGKILL)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def nginx(replicas: list[Replica]) -> Iterator[Nginx]:
    with _nginx([r.address for r in replicas], [r.http_address for r in replicas]) as n:
        yield n


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_call_through_nginx_with_the_readme_command(nginx: Nginx) -> None:
    done = run(command('pie-client --address "$PIE_GRPC_LISTEN"'), nginx.env)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.split()) >= 5


def test_with_no_replica_left_nginx_answers_unavailable_and_the_client_retries() -> None:
    dead = [f"127.0.0.1:{_free_port()}" for _ in range(4)]  # nothing listens on them
    with _nginx(dead[:2], dead[2:]) as n, pie_client.Client(n.grpc_address, timeout=DEADLINE_S) as client:
        with pytest.raises(pie_client.Unavailable, match="nginx: no pie replica could take the call"):
            client.generate("Once upon a time", max_tokens=4)
        # (nginx logs a call once it has answered it: the caller may read the answer first.)
        calls = wait_until(lambda: len(n.access_log()) >= 4 and n.access_log(), what="nginx's log of four calls")
        # Four attempts (the client's retry policy): nginx tried both replicas for the first, then
        # left them out (max_fails=1) and answered the others at once.
        assert len(calls) == 4, calls
        assert re.search(rf'upstream="({dead[0]}|{dead[1]}), ({dead[0]}|{dead[1]})" upstream_status="502, 502"',
                         calls[0]), calls[0]
        assert all('upstream="pie_grpc" upstream_status="502"' in line for line in calls[1:]), calls
        assert all('grpc_status_header="14"' in line for line in calls), calls
        with pie_client.Client(n.grpc_address, timeout=DEADLINE_S, retry=False) as once:
            with pytest.raises(pie_client.Unavailable):
                once.model_info()
        assert len(wait_until(lambda: len(n.access_log()) >= 5 and n.access_log(), what="the fifth call")) == 5


def _model(nginx: Nginx) -> str:
    return openai.OpenAI(base_url=f"{nginx.http_url}/v1", api_key="-", max_retries=0).models.list().data[0].id


def test_http_through_nginx_round_robin_and_unbuffered_events(replicas: list[Replica], nginx: Nginx) -> None:
    done = run(command("curl "), nginx.env)
    assert done.returncode == 0, done.stderr
    events = [line.removeprefix("data: ") for line in done.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", done.stdout
    text = "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])
    assert len(text.split()) >= 5, done.stdout

    # Per call: one client, one kept-alive connection to nginx, and consecutive calls alternate.
    api = openai.OpenAI(base_url=f"{nginx.http_url}/v1", api_key="-", max_retries=0, timeout=DEADLINE_S)
    model = _model(nginx)
    ids = [f"http-rr-{i}" for i in range(20)]
    for rid in ids:
        out = api.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0,
                                     extra_headers={"x-request-id": rid})
        assert out.choices[0].text
    wanted = set(ids)
    wait_until(lambda: replicas[0].served(wanted) | replicas[1].served(wanted) == wanted, timeout=10,
               what="both replicas' logs of the calls")
    counts = [len(r.served(wanted)) for r in replicas]
    assert min(counts) >= 8, counts

    # Server-sent events pass nginx as they are made: the first long before the last.
    start = time.monotonic()
    arrivals = [time.monotonic() - start for _ in api.completions.create(
        model=model, prompt="Once upon a time", max_tokens=96, temperature=0, stream=True)]
    assert len(arrivals) >= 10 and arrivals[0] < 0.5 * arrivals[-1], arrivals


def test_the_http_port_serves_the_metrics_the_inference_pool_reads(replicas: list[Replica]) -> None:
    # deploy/k8s/inferencepool.yaml targets the HTTP port; its endpoint picker reads /metrics there.
    with urllib.request.urlopen(f"http://{replicas[0].http_address}/metrics", timeout=10) as response:
        names = {line.split("{")[0] for line in response.read().decode().splitlines() if not line.startswith("#")}
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"} <= names


@dataclass
class Attempt:
    """One call of the load."""
    request: int
    number: int  # 1 for the first attempt of its request
    kind: str  # one of KINDS
    start: float
    end: float = 0.0
    code: str = "OK"  # when it failed: the gRPC code's name, or "HTTP <status>", "HTTP connection"
    deltas: int = 0  # stream messages received (before the error, if any)
    text: str = ""

    @property
    def request_id(self) -> str:
        return f"load-{self.request}-{self.number}"


@dataclass
class Load:
    attempts: list[Attempt] = field(default_factory=list)
    kill_at: float | None = None


async def _one(client: pie_client.AsyncClient, api: openai.AsyncOpenAI, model: str, request: int, number: int,
               load: Load) -> Attempt:
    kind = KINDS[request % len(KINDS)]
    a = Attempt(request, number, kind, time.monotonic())
    load.attempts.append(a)
    prompt = f"Once upon a time, child number {request} found"
    try:
        if kind == "unary":
            out = await client.generate(prompt, request_id=a.request_id, max_tokens=MAX_TOKENS, temperature=0)
            a.text, finish = out.text, out.finish_reason
        elif kind == "stream":
            finish = None
            async for delta in client.stream(prompt, request_id=a.request_id, max_tokens=MAX_TOKENS, temperature=0):
                a.deltas += 1
                a.text += delta.text
                finish = delta.finish_reason or finish
        else:
            completion = await api.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                      extra_headers={"x-request-id": a.request_id})
            a.text, finish = completion.choices[0].text, completion.choices[0].finish_reason
        assert finish, a
    except pie_client.PieError as e:
        a.code = e.code.name
    except openai.APIStatusError as e:
        a.code = f"HTTP {e.status_code}"
    except openai.APIConnectionError:
        a.code = "HTTP connection"
    a.end = time.monotonic()
    return a


async def _drive(nginx: Nginx, model: str, victim: Replica) -> Load:
    """REQUESTS requests, CONCURRENCY at a time; the victim is killed once KILL_AFTER have finished.
    A request whose call fails is sent again (a new call with its own id), ATTEMPTS times at most."""
    load = Load()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(REQUESTS):
        queue.put_nowait(i)
    finished = 0

    async def worker(client: pie_client.AsyncClient, api: openai.AsyncOpenAI) -> None:
        nonlocal finished
        while not queue.empty():
            request = queue.get_nowait()
            for number in range(1, ATTEMPTS + 1):
                if (await _one(client, api, model, request, number, load)).code == "OK":
                    break
            finished += 1
            if finished == KILL_AFTER:
                victim.server.proc.send_signal(signal.SIGKILL)
                load.kill_at = time.monotonic()

    api = openai.AsyncOpenAI(base_url=f"{nginx.http_url}/v1", api_key="-", max_retries=0, timeout=DEADLINE_S)
    async with pie_client.AsyncClient(nginx.grpc_address, timeout=DEADLINE_S) as client, api:
        await asyncio.wait_for(asyncio.gather(*(worker(client, api) for _ in range(CONCURRENCY))), timeout=900)
    return load


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def test_one_replica_killed_under_load(replicas: list[Replica], nginx: Nginx) -> None:
    victim, survivor = replicas
    log_before = len(nginx.access_log())
    load = asyncio.run(_drive(nginx, _model(nginx), victim))
    assert load.kill_at is not None
    kill_at = load.kill_at
    attempts = load.attempts
    failed = [a for a in attempts if a.code != "OK"]
    by_request: dict[int, list[Attempt]] = {}
    for a in attempts:
        by_request.setdefault(a.request, []).append(a)

    # Every request ended with its whole answer, none lost, and every call within its deadline.
    assert sorted(by_request) == list(range(REQUESTS))
    for tries in by_request.values():
        assert tries[-1].code == "OK" and tries[-1].text, tries
    assert all(a.end - a.start < DEADLINE_S for a in attempts)
    # Only gRPC calls in flight on the victim when it died failed: started before the kill, ended
    # soon after it, as INTERNAL (nginx resets a call whose replica died after sending its headers)
    # or UNAVAILABLE; a deadline never ran out. HTTP completions send nothing before their answer,
    # so nginx gave those in flight to the survivor.
    assert len(failed) <= CONCURRENCY, failed
    for a in failed:
        assert a.kind != "http" and a.code in ("INTERNAL", "UNAVAILABLE"), a
        assert a.start < kill_at < a.end < kill_at + 5.0, a

    # Balanced per call before the kill; the survivor served everything started after it.
    before = {a.request_id for a in attempts if a.code == "OK" and a.end < kill_at}
    on_victim = victim.served(before)
    on_survivor = survivor.served(before)
    assert on_victim | on_survivor == before
    assert min(len(on_victim), len(on_survivor)) >= 0.3 * len(before), (len(on_victim), len(on_survivor))
    after = {a.request_id for a in attempts if a.code == "OK" and a.start > kill_at}
    wait_until(lambda: survivor.served(after) == after, timeout=10, what="the survivor's log of every later call")
    assert victim.server.proc.wait(10) == -signal.SIGKILL
    assert readiness(survivor.address) == health_pb2.HealthCheckResponse.SERVING

    # The failover figures.
    later = [a for a in attempts if a.start > kill_at and a.code == "OK"]
    first_ok_after = min(a.end for a in later) - kill_at
    cut_resolved = max(a.end for a in attempts if a.start < kill_at) - kill_at
    log = nginx.access_log()[log_before:]
    passed_on = [line for line in log if re.search(r'upstream="[^"]*, ', line)]
    passed_grpc = sum("/pie.v1.GenerateService/" in line for line in passed_on)
    lat_before = [a.end - a.start for a in attempts if a.code == "OK" and a.end < kill_at]
    lat_after = [a.end - a.start for a in later]
    failures = ", ".join(f"{a.kind} {a.code} after {a.deltas} deltas" if a.kind == "stream" else f"{a.kind} {a.code}"
                         for a in failed) or "none"
    print(f"\nfailover through nginx: {REQUESTS} requests ({len(attempts)} calls: gRPC unary, gRPC stream and "
          f"HTTP /v1/completions alike), {CONCURRENCY} at a time, one replica SIGKILLed after {KILL_AFTER}")
    print(f"  failures seen by the caller: {len(failed)} ({failures}); each sent again and answered")
    print(f"  calls nginx gave to the other replica, unseen by the caller: {len(passed_on)} "
          f"({passed_grpc} gRPC, {len(passed_on) - passed_grpc} HTTP)")
    print(f"  time to recover: the first call started after the kill answered {_ms(first_ok_after)} after it; "
          f"every call in flight at the kill had ended {_ms(cut_resolved)} after it")
    print(f"  latency p50 / max: before the kill {_ms(statistics.median(lat_before))} / {_ms(max(lat_before))}, "
          f"after {_ms(statistics.median(lat_after))} / {_ms(max(lat_after))}")
    print(f"  served before the kill: {len(on_victim)} by the killed replica, {len(on_survivor)} by the survivor")
