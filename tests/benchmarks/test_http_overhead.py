"""benchmarks/http_overhead.py: its HTTP client's reading of chunked server-sent events, its
check that stops the run where the doors' texts part, and CI's smoke run of the whole on the
bundled model (both HTTP clients, two rounds in a rotated order)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.http_overhead import HttpConnection, Stream, check

ROOT = Path(__file__).resolve().parents[2]


def test_events_read_across_chunk_boundaries_and_keep_the_connection():
    """Events split over chunks, two in one chunk, [DONE] skipped; a second request on the same
    connection reads its own events."""
    events = [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}, {"choices": [], "usage": {"n": 2}}]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    pieces = [body[:10], body[10:47], body[47:]]  # cuts inside the first and the second event
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            request = await reader.readuntil(b"\r\n\r\n")
            length = int(next(ln for ln in request.split(b"\r\n") if ln.lower().startswith(b"content-length"))
                         .split(b":")[1])
            seen.append(await reader.readexactly(length))
            writer.write(head + chunked)
            await writer.drain()
        writer.close()

    async def run() -> list[list[dict]]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        conn = HttpConnection(reader, writer, f"127.0.0.1:{port}")
        got = [[e async for e in conn.events("/v1/completions", {"i": i})] for i in range(2)]
        writer.close()
        server.close()
        return got

    got = asyncio.run(run())
    assert got == [events, events]
    assert [json.loads(b) for b in seen] == [{"i": 0}, {"i": 1}]


def test_an_error_status_is_raised_with_its_body():
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        text = b'{"error": {"message": "max_tokens: must be >= 1"}}'
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(text), text))
        await writer.drain()
        writer.close()

    async def run() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            async for _ in HttpConnection(reader, writer, "x").events("/v1/completions", {}):
                pass
        finally:
            writer.close()
            server.close()

    with pytest.raises(RuntimeError, match="HTTP 400: .*max_tokens: must be >= 1"):
        asyncio.run(run())


class _FakeDoor:
    def __init__(self, name: str, text: str) -> None:
        self.name, self.text = name, text

    @contextlib.asynccontextmanager
    async def sender(self):
        async def send(prompt, max_tokens, seed):
            return Stream(0.0, text=self.text)

        yield send


def test_check_stops_the_run_when_the_doors_differ():
    same = [_FakeDoor("gRPC", "Lily ran."), _FakeDoor("HTTP", "Lily ran.")]
    assert asyncio.run(check(same, 8, 1)) == "Lily ran."  # type: ignore[arg-type]
    with pytest.raises(SystemExit, match=r"different text.*\n  gRPC: 'Lily ran.'\n  HTTP: 'Lily sat.'"):
        asyncio.run(check([same[0], _FakeDoor("HTTP", "Lily sat.")], 8, 1))  # type: ignore[arg-type]


def test_itl_splits_a_gap_over_its_tokens():
    grpc = Stream(0.0, arrivals=[1.0, 1.2, 1.5], counts=[1, 2, 1], tokens=4)
    assert grpc.itl() == pytest.approx([0.1, 0.1, 0.3])
    http = Stream(0.0, arrivals=[1.0, 1.2, 1.5], counts=None, tokens=3)  # one token per chunk
    assert http.itl() == pytest.approx([0.2, 0.3])


@pytest.mark.slow
def test_tiny_run_on_the_bundled_model(tmp_path):
    out = tmp_path / "http.json"
    run = subprocess.run([sys.executable, "benchmarks/http_overhead.py", "--tiny", "--http-clients", "raw,openai",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads(out.read_text())
    doors = ["gRPC", "HTTP", "HTTP (openai)"]
    assert [r["order"] for r in result["rounds"]] == [doors, doors[1:] + doors[:1]]  # the order rotates
    for r in result["rounds"]:
        assert r["check_text"] and 0 <= r["same_text_under_load"] <= 2
        for door in doors:
            row = r["doors"][door]
            assert row["requests"] == 2 and row["tokens"] == 16 and row["tok_per_s"] > 0
            assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and row["itl_p50_ms"] > 0
    assert set(result["summary"]) == {*doors, "HTTP / gRPC", "HTTP (openai) / gRPC"}
    assert "| HTTP / gRPC | " in run.stdout and "| gRPC | " in run.stdout
