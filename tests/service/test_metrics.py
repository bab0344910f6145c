"""Prometheus metrics and the per-request summary log line, read from a real server after traffic.

The server serves /metrics on a free port (metrics_port=0); the test scrapes it with urllib and
parses the text format with prometheus_client's own parser. Logs go to a buffer as JSON lines
through the production `configure_logging`.
"""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request

import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from pie.engine.config import EngineConfig
from pie.service.logging import configure_logging
from pie.service.metrics import ServiceMetrics
from pie.service.server import BackgroundServer, ServerConfig
from pie_client import Client, InvalidArgument
from tests.helpers import make_hf_model_dir, wait_until

MODEL = "tiny-llama"
PROMPTS = ["the cat sat on a mat", "a dog runs under the old bridge today", "red blue green"]


@pytest.fixture(scope="module")
def log_buffer():
    saved = structlog.get_config()
    buf = io.StringIO()
    configure_logging(json=True, stream=buf)
    yield buf
    structlog.configure(**saved)


@pytest.fixture(scope="module")
def server(tmp_path_factory, log_buffer):
    # a long context, so the stream the gauge test holds open cannot end before it is scraped
    model_dir = make_hf_model_dir(tmp_path_factory.mktemp("llama"), "llama", weight_scale=4.0,
                                  max_position_embeddings=8192)
    cfg = EngineConfig(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", block_size=16,
                       num_kv_blocks=640, max_num_seqs=8, max_num_batched_tokens=256, max_waiting=16)
    with BackgroundServer(ServerConfig(port=0, grace_s=5, model_name=MODEL, metrics_port=0), cfg) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=60) as c:
        yield c


def scrape(server) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} from the live endpoint."""
    url = f"http://{server.pie.config.host}:{server.pie.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name: str, default: float | None = None, **labels) -> float:
    """A sample's value; `default` when given stands for a labelled series not exported yet."""
    key = (name, frozenset({"model_name": MODEL, **labels}.items()))
    return samples[key] if default is None else samples.get(key, default)


def _le(labels: frozenset) -> float:
    """A bucket sample's upper bound, for sorting (+Inf last); 0 for samples without one."""
    return float(dict(labels).get("le", "0"))


def log_lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_metrics_after_traffic(server, client, log_buffer):
    before = scrape(server)
    assert value(before, "vllm:generation_tokens_total") == 0
    assert value(before, "vllm:num_requests_running") == 0
    assert value(before, "vllm:kv_cache_usage_perc") == 0

    kw = dict(max_tokens=5, ignore_eos=True, temperature=0)
    client.generate(PROMPTS[0], request_id="metrics-u0", **kw)
    client.generate(PROMPTS[1], request_id="metrics-u1", **kw)
    deltas = list(client.stream(PROMPTS[2], request_id="metrics-s0", **kw))
    assert sum(len(d.token_ids) for d in deltas) == 5
    with pytest.raises(InvalidArgument):
        client.generate("x", request_id="metrics-bad", max_tokens=5, temperature=-1.0)

    m = scrape(server)
    tok = server.core.tokenizer
    assert value(m, "vllm:generation_tokens_total") == 15
    assert value(m, "vllm:prompt_tokens_total") == sum(len(tok.encode(p)) for p in PROMPTS)
    assert value(m, "vllm:request_success_total", finished_reason="length") == 3
    assert value(m, "vllm:request_success_total", finished_reason="stop") == 0
    assert value(m, "vllm:time_to_first_token_seconds_count") == 3
    assert value(m, "vllm:e2e_request_latency_seconds_count") == 3
    assert value(m, "vllm:request_queue_time_seconds_count") == 3
    assert value(m, "vllm:request_generation_tokens_sum") == 15
    # One inter-token sample per token after the first message of each request: at most 4 each.
    itl = value(m, "vllm:inter_token_latency_seconds_count")
    assert 0 < itl <= 12
    assert value(m, "vllm:e2e_request_latency_seconds_sum") >= value(m, "vllm:time_to_first_token_seconds_sum") > 0
    assert value(m, "pie_requests_finished_total", rpc="Generate", code="OK") == 2
    assert value(m, "pie_requests_finished_total", rpc="GenerateStream", code="OK") == 1
    assert value(m, "pie_requests_finished_total", rpc="Generate", code="INVALID_ARGUMENT") == 1
    queries, hits = value(m, "vllm:prefix_cache_queries_total"), value(m, "vllm:prefix_cache_hits_total")
    assert 0 <= hits <= queries
    assert value(m, "pie_kv_blocks_cached") == server.core.stats().kv_blocks_cached
    assert value(m, "vllm:num_preemptions_total") == 0
    assert value(m, "vllm:num_requests_running") == 0
    # Engine steps by duration and kind: the steps of each request after its first (the first after
    # an idle engine has no previous step to be timed from), 15 steps in all at most.
    steps = {kind: value(m, "pie_step_duration_seconds_count", kind=kind) for kind in ("decode", "prompt")}
    assert 0 < sum(steps.values()) <= 15 and steps["decode"] > 0
    for kind, n in steps.items():
        cumulative = [v for (name, labels), v in sorted(m.items(), key=lambda kv: _le(kv[0][1]))
                      if name == "pie_step_duration_seconds_bucket" and ("kind", kind) in labels]
        assert len(cumulative) == 14 and cumulative == sorted(cumulative) and cumulative[-1] == n
    assert value(m, "pie_step_duration_seconds_sum", kind="decode") > 0
    # The prompt tokens those steps carried (at most the three prompts'), and steps beside decodes
    # that no stall bound limited (a counter; the CPU's bound learns from the first steps).
    assert 0 <= value(m, "pie_step_prompt_tokens_total") <= sum(len(tok.encode(p)) for p in PROMPTS)
    assert value(m, "pie_steps_unbounded_total") >= 0
    # What the bound learnt: no decode model on the CPU (no CUDA graphs), so its ratio stays 1.
    assert value(m, "pie_stall_bound_decode_ratio") == 1.0
    assert value(m, "pie_stall_bound_fixed_seconds") >= 0 and value(m, "pie_stall_bound_prompt_token_seconds") >= 0

    # The summary lines: one per request, with the fields an operator greps for.
    lines = {d["request_id"]: d for d in log_lines(log_buffer) if d.get("event") == "request_done"}
    u0 = lines["metrics-u0"]
    assert u0["rpc"] == "Generate" and u0["status"] == "OK" and u0["finish_reason"] == "length"
    assert u0["prompt_tokens"] == len(tok.encode(PROMPTS[0])) and u0["generated_tokens"] == 5
    assert u0["peer"].startswith("ipv4:127.0.0.1:") and u0["level"] == "info"
    assert 0 < u0["ttft_ms"] <= u0["total_ms"]
    s0 = lines["metrics-s0"]
    assert s0["rpc"] == "GenerateStream" and s0["generated_tokens"] == 5 and s0["status"] == "OK"
    bad = lines["metrics-bad"]
    assert bad["status"] == "INVALID_ARGUMENT" and bad["level"] == "warning"
    assert bad["prompt_tokens"] is None and bad["generated_tokens"] == 0 and "temperature" in bad["error"]
    assert sum(1 for d in log_lines(log_buffer) if d.get("request_id") == "metrics-u0"
               and d.get("event") == "request_done") == 1


@pytest.mark.slow
def test_gauges_during_a_stream_and_cancellation(server, client, log_buffer):
    before = scrape(server)
    cancelled_before = before.get(("pie_requests_finished_total", frozenset(
        {"model_name": MODEL, "rpc": "GenerateStream", "code": "CANCELLED"}.items())), 0)
    it = client.stream("a b c d e f", request_id="metrics-long", max_tokens=8000, ignore_eos=True, temperature=0)
    next(it)
    m = wait_until(lambda: (s := scrape(server)) and value(s, "vllm:num_requests_running") == 1 and s,
                   what="the running gauge to show the stream")
    assert 0 < value(m, "vllm:kv_cache_usage_perc") <= 1
    it.close()  # cancels the RPC
    wait_until(lambda: value(scrape(server), "pie_requests_finished_total", 0.0, rpc="GenerateStream",
                             code="CANCELLED") == cancelled_before + 1, what="the cancellation to be counted")
    m = wait_until(lambda: (s := scrape(server)) and value(s, "vllm:num_requests_running") == 0 and s,
                   what="the running gauge to drop")
    line = next(d for d in log_lines(log_buffer) if d.get("request_id") == "metrics-long"
                and d.get("event") == "request_done")
    assert line["status"] == "CANCELLED" and line["finish_reason"] is None and line["generated_tokens"] >= 1


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/", "/metric", "/metrics/", "/metrics/x", "/favicon.ico", "/index.html"])
def test_only_the_metrics_path_answers(server, path):
    base = f"http://{server.pie.config.host}:{server.pie.metrics_port}"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(base + path, timeout=10)
    assert err.value.code == 404
    assert err.value.read().decode() == "not found: metrics are served at /metrics\n"
    with urllib.request.urlopen(base + "/metrics?scrape=1", timeout=10) as r:
        assert r.status == 200 and b"vllm:prompt_tokens_total" in r.read()


def test_metrics_off_by_default_and_registries_are_per_server():
    assert ServerConfig().metrics_port is None
    a, b = ServiceMetrics("a"), ServiceMetrics("a")  # same names, same labels: no clash
    a.request_finished(rpc="Generate", code="OK", prompt_tokens=3, generated_tokens=2, finished_reason="stop")
    assert a.registry.get_sample_value("vllm:generation_tokens_total", {"model_name": "a"}) == 2
    assert b.registry.get_sample_value("vllm:generation_tokens_total", {"model_name": "a"}) == 0
    assert a.registry.get_sample_value("vllm:num_requests_running", {"model_name": "a"}) is None  # no engine yet


def test_inter_token_gap_is_split_over_coalesced_tokens():
    m = ServiceMetrics("m")
    m.token_gap(0.3, 3)
    m.token_gap(0.1, 1)
    get = m.registry.get_sample_value
    assert get("vllm:inter_token_latency_seconds_count", {"model_name": "m"}) == 4
    assert get("vllm:inter_token_latency_seconds_sum", {"model_name": "m"}) == pytest.approx(0.4)
    assert get("vllm:inter_token_latency_seconds_bucket", {"model_name": "m", "le": "0.1"}) == 4


def test_kv_tier_series_come_with_a_host_tier():
    """With --kv-host-gib the tiers' series appear (by tier), and cache_config_info names the host
    tier's blocks as vLLM's num_cpu_blocks; without it, no tier series and num_cpu_blocks 0."""
    from pie.engine.messages import EngineStats

    stats = EngineStats(kv_blocks_total=100, kv_blocks_free=60, requests_running=1, requests_waiting=0,
                        kv_host_blocks_total=400, kv_host_blocks_used=120, kv_disk_blocks_used=300,
                        kv_disk_bytes_total=1 << 30, kv_disk_bytes_used=3 << 20,
                        kv_tier_hit_tokens={"host": 64, "disk": 32}, kv_tier_read_bytes={"host": 8, "disk": 4},
                        kv_tier_write_bytes={"host": 16, "disk": 12}, kv_tier_errors={"host": 0, "disk": 1},
                        kv_readbacks=3, kv_readback_seconds=0.25)
    m = ServiceMetrics("m", lambda: stats, cache_config={"block_size": "16", "cache_dtype": "int8"})
    get = m.registry.get_sample_value
    info = {"block_size": "16", "cache_dtype": "int8", "num_gpu_blocks": "100",
            "num_cpu_blocks": "400"}
    assert get("vllm:cache_config_info", info) == 1.0
    assert get("vllm:kv_cache_usage_perc", {"model_name": "m"}) == pytest.approx(0.4)
    assert get("pie_kv_host_blocks", {"model_name": "m"}) == 120
    assert get("pie_kv_disk_bytes", {"model_name": "m"}) == 3 << 20
    assert get("pie_kv_tier_hit_tokens_total", {"model_name": "m", "tier": "disk"}) == 32
    assert get("pie_kv_tier_errors_total", {"model_name": "m", "tier": "disk"}) == 1
    assert get("pie_kv_readback_seconds_count", {"model_name": "m"}) == 3
    assert get("pie_kv_readback_seconds_sum", {"model_name": "m"}) == 0.25
    plain = EngineStats(kv_blocks_total=100, kv_blocks_free=60, requests_running=1, requests_waiting=0)
    m = ServiceMetrics("m", lambda: plain, cache_config={"block_size": "16", "cache_dtype": "int8"})
    assert m.registry.get_sample_value("vllm:cache_config_info", {**info, "num_cpu_blocks": "0"}) == 1.0
    assert m.registry.get_sample_value("pie_kv_host_blocks", {"model_name": "m"}) is None
