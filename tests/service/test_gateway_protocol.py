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
                                         sampling=pb.SamplingParams(max_tokens=40, ignore_eos=True)), timeout=120)
        done.append(adapter)

    core = server.core
    gate.hold()
    threads = [threading.Thread(target=generate, args=(a,)) for a in ("alpha", "alpha", "beta", "")]
    try:
        for t in threads:
            t.start()
        # steps one at a time until the batch is full (2 rows, the one adapter slot busy) and the rest waits
        wait_until(lambda: (gate.allow(1) or True) and core.scheduler.num_running == 2
                   and core.scheduler.num_waiting == 2, timeout=60, what="two running, two waiting")
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
        bm = core.block_manager
        assert sample["vllm:kv_cache_usage_perc"] == pytest.approx(1 - bm.num_free_blocks / bm.num_total_blocks)
        assert 0 < sample["vllm:kv_cache_usage_perc"] < 1
        info = fam["vllm:cache_config_info"]
        assert info.type == "gauge" and info.samples[0].labels["block_size"] == "16"
        assert info.samples[0].labels["num_gpu_blocks"] == str(BLOCKS)
        lora = fam["vllm:lora_requests_info"]
        labels = lora.samples[0].labels
        assert lora.type == "gauge" and labels["max_lora"] == "1"
        resident = {a.name for a in stats.adapters if a.resident}
        waiting = {a.name for a in stats.adapters if a.waiting}
        # the requests race to the engine: whichever adapter came first holds the one slot, the other waits
        assert set(labels["running_lora_adapters"].split(",")) == resident and len(resident) == 1
        (holder,) = resident
        other = {"alpha": "beta", "beta": "alpha"}[holder]
        assert other in set(labels["waiting_lora_adapters"].split(",")) and other in waiting
    finally:
        gate.release()
        for t in threads:
            t.join(120)
    assert sorted(done) == ["", "alpha", "alpha", "beta"]
