"""The Gateway API Inference Extension's model-server protocol (docs/proposals/003-model-server-
protocol, which llm-d's router follows), scraped from a live server while requests run and wait,
held still between steps: every metric the endpoint picker reads has the type the protocol
requires and says what the engine's own state says (queued and running requests as gauges, KV
cache utilization, cache_config_info's block_size and num_gpu_blocks labels, the LoRA gauge's
slots, adapters in GPU memory and adapters with waiting requests)."""

from __future__ import annotations

import threading
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pie.engine.config import EngineConfig
from pie.service.server import BackgroundServer, ServerConfig
from pie.v1 import generate_pb2 as pb
from pie.v1 import generate_pb2_grpc
from tests.helpers import StepGate, make_hf_model_dir, save_peft_adapter, wait_until

pytest.importorskip("peft")
pytestmark = pytest.mark.slow  # starts a server

BLOCKS = 96


@pytest.fixture(scope="module")
def gate() -> StepGate:
    return StepGate()


@pytest.fixture(scope="module")
def server(tmp_path_factory, gate):
    root = tmp_path_factory.mktemp("gateway")
    model_dir = make_hf_model_dir(root, "llama", seed=5)
    loras = tuple((name, str(save_peft_adapter(model_dir, root / name, seed=i, scale=1.0, r=4, lora_alpha=4,
                                               target_modules=["q_proj", "v_proj"])))
                  for i, name in enumerate(("alpha", "beta")))
    config = ServerConfig(port=0, http_port=0, metrics_port=0, grace_s=2, engine_setup=gate, model_name="tiny")
    engine = EngineConfig(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", num_kv_blocks=BLOCKS,
                          max_num_seqs=2, max_loras=1, max_lora_rank=8, loras=loras)
    with BackgroundServer(config, engine) as s:
        yield s


def _families(server) -> dict:
    url = f"http://{server.pie.config.host}:{server.pie.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        return {f.name: f for f in text_string_to_metric_families(r.read().decode())}


def test_the_endpoint_pickers_metrics_say_what_the_engine_holds(server, gate):
    stub = generate_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(server.address))
    done: list[str] = []

    def generate(adapter: str) -> None:
        stub.Generate(pb.GenerateRequest(prompt="a b c d e f g h", adapter=adapter,
                                         sampling=pb.SamplingParams(max_tokens=200, ignore_eos=True)), timeout=120)
        done.append(adapter)

    core = server.core
    gate.hold()
    threads: list[threading.Thread] = []

    def arrive(adapter: str, then: tuple[int, int]) -> None:
        """Sends one request and steps the engine one step at a time until it holds (running, waiting)."""
        threads.append(threading.Thread(target=generate, args=(adapter,)))
        threads[-1].start()
        wait_until(lambda: (gate.step_when_idle() or True)
                   and (core.scheduler.num_running, core.scheduler.num_waiting) == then,
                   timeout=60, what=f"{adapter or 'the base model'}'s request in: {then} running, waiting")

    try:
        # In this order (the requests one at a time, so no race decides it): alpha runs and takes the
        # one adapter slot; beta waits for the slot though the batch has room; the base model's request
        # passes it; the second alpha waits for the full batch (2 rows).
        arrive("alpha", (1, 0))
        arrive("beta", (1, 1))
        arrive("", (2, 1))
        arrive("alpha", (2, 2))
        gate.allow(1)  # one more step, so that the published stats are those of this batch
        wait_until(lambda: server.pie.admission.engine_client.stats().requests_waiting == 2, timeout=30,
                   what="the stats of the full batch")
        fam = _families(server)
        stats = server.pie.admission.engine_client.stats()
        assert fam["vllm:num_requests_waiting"].type == "gauge"
        assert fam["vllm:num_requests_running"].type == "gauge"
        assert fam["vllm:kv_cache_usage_perc"].type == "gauge"
        sample = {f: fam[f].samples[0].value for f in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                                                          "vllm:kv_cache_usage_perc")}
        assert sample["vllm:num_requests_waiting"] == stats.requests_waiting == 2
        assert sample["vllm:num_requests_running"] == stats.requests_running == 2
        # the engine's published state exactly; the live pool within what one step allocates (a held
        # step waits after its schedule took its blocks: one a running row at most)
        assert sample["vllm:kv_cache_usage_perc"] == pytest.approx(1 - stats.kv_blocks_free / stats.kv_blocks_total)
        bm = core.block_manager
        live = 1 - bm.num_free_blocks / bm.num_total_blocks
        assert abs(sample["vllm:kv_cache_usage_perc"] - live) <= 2 / BLOCKS + 1e-9
        assert 0 < sample["vllm:kv_cache_usage_perc"] < 1
        info = fam["vllm:cache_config_info"]
        assert info.type == "gauge" and info.samples[0].labels["block_size"] == "16"
        assert info.samples[0].labels["num_gpu_blocks"] == str(BLOCKS)
        lora = fam["vllm:lora_requests_info"]
        labels = lora.samples[0].labels
        assert lora.type == "gauge" and labels["max_lora"] == "1"
        resident = {a.name for a in stats.adapters if a.resident}
        waiting = {a.name for a in stats.adapters if a.waiting}
        held = ([r.adapter and r.adapter.name for r in core.scheduler.running],
                [r.adapter and r.adapter.name for r in core.scheduler.waiting])
        assert held == (["alpha", None], ["beta", "alpha"]), held
        assert labels["running_lora_adapters"] == "alpha" and resident == {"alpha"}
        assert set(labels["waiting_lora_adapters"].split(",")) == {"alpha", "beta"} == waiting
    finally:
        gate.release()
        for t in threads:
            t.join(120)
    assert sorted(done) == ["", "alpha", "alpha", "beta"]
