"""LoRA adapters on a live server, through both doors: an adapter loaded at start (`--lora`) and
one loaded at run time serve peft's greedy tokens; unknown names are NOT_FOUND / 404; adapters
that cannot be served are refused naming them while the server keeps serving; /v1/models lists
them with their parent; the Gateway API Inference Extension's `vllm:lora_requests_info` gauge
and the per-adapter counters; loads and unloads under concurrent streams lose no request."""

from __future__ import annotations

import json
import random
import threading
import urllib.error
import urllib.request

import grpc
import pytest
import torch

from pie.engine.config import EngineConfig
from pie.service.server import BackgroundServer, ServerConfig
from pie.v1 import generate_pb2 as pb
from pie.v1 import generate_pb2_grpc
from tests.fidelity import reference_greedy
from tests.helpers import make_hf_model_dir, save_peft_adapter
from tests.service.test_metrics import scrape

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.slow  # starts a server

TOKENS = 8
ADAPTERS = {"qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
            "mlp": dict(r=16, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
            "big": dict(r=32, lora_alpha=16, target_modules=["q_proj"])}


def _hf(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serving")
    model_dir = make_hf_model_dir(root, "llama", seed=21, weight_scale=2.5)
    folders = {}
    for i, (name, conf) in enumerate(ADAPTERS.items()):
        folders[name] = save_peft_adapter(model_dir, root / name, seed=200 + i, scale=3.0, **conf)
    rng = random.Random(3)
    prompt = [rng.randrange(3, 200) for _ in range(12)]
    want = {None: reference_greedy(_hf(model_dir), [prompt], TOKENS)[0]}
    for name in ("qv", "mlp"):
        want[name] = reference_greedy(peft.PeftModel.from_pretrained(_hf(model_dir), folders[name]).eval(),
                                      [prompt], TOKENS)[0]
    config = ServerConfig(port=0, http_port=0, metrics_port=0, grace_s=2, model_name="tiny")
    engine = EngineConfig(model=str(model_dir), device="cpu", dtype="fp32", kv_cache_dtype="fp32", num_kv_blocks=128,
                          max_num_seqs=4, max_loras=1, max_lora_rank=16, loras=(("qv", str(folders["qv"])),))
    with BackgroundServer(config, engine) as server:
        yield server, folders, prompt, want


def _stub(server):
    return generate_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(server.address))


def _generate(stub, prompt, adapter: str = "") -> list[int]:
    r = stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), adapter=adapter,
                                         sampling=pb.SamplingParams(max_tokens=TOKENS, temperature=0,
                                                                    ignore_eos=True)), timeout=120)
    return list(r.token_ids)


def _http(server, path: str, body: dict | None = None, method: str = "POST") -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{server.http_url}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read().decode()
            return r.status, json.loads(raw) if r.headers.get_content_type() == "application/json" else raw
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _status(err: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    return err.code(), err.details()


def test_adapters_serve_peft_tokens_through_both_doors(setup):
    server, folders, prompt, want = setup
    stub = _stub(server)
    assert _generate(stub, prompt) == want[None]
    assert _generate(stub, prompt, "qv") == want["qv"] != want[None]
    # loaded at run time, then through the HTTP door (its `model` names the adapter)
    assert _http(server, "/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": str(folders["mlp"])})[0] == 200
    status, body = _http(server, "/v1/completions", {"model": "mlp", "prompt": prompt, "max_tokens": TOKENS,
                                                     "temperature": 0, "logprobs": 0, "ignore_eos": True})
    assert status == 200 and body["model"] == "mlp", body
    assert _generate(stub, prompt, "mlp") == want["mlp"]
    listed = stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30)
    assert {a.name for a in listed.adapters} == {"qv", "mlp"} and listed.max_loras == 1 and listed.max_lora_rank == 16
    status, models = _http(server, "/v1/models", method="GET")
    assert [(m["id"], m.get("parent")) for m in models["data"]] == [("tiny", None), ("mlp", "tiny"), ("qv", "tiny")]
    assert _http(server, "/v1/models/mlp", method="GET")[1]["parent"] == "tiny"
    samples = scrape(server)
    info = [labels for (name, labels), _ in samples.items() if name == "vllm:lora_requests_info"]
    assert info and dict(info[0])["max_lora"] == "1"
    assert samples[("pie_adapter_requests_total", frozenset({"model_name": "tiny", "adapter": "mlp",
                                                              "code": "OK"}.items()))] == 2


def test_refusals_name_the_adapter_and_the_server_keeps_serving(setup):
    server, folders, prompt, want = setup
    stub = _stub(server)
    with pytest.raises(grpc.RpcError) as err:
        _generate(stub, prompt, "nope")
    assert _status(err.value) == (grpc.StatusCode.NOT_FOUND, "adapter 'nope': not loaded")
    status, body = _http(server, "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user",
                                                                                          "content": "hi"}]})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    with pytest.raises(grpc.RpcError) as err:  # rank 32 above --max-lora-rank 16
        stub.LoadAdapter(pb.LoadAdapterRequest(name="big", path=str(folders["big"])), timeout=30)
    code, message = _status(err.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "adapter 'big': rank 32 is above" in message
    status, body = _http(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/folder"})
    assert status == 400 and body["error"]["param"] == "lora_path" and "adapter 'x'" in body["error"]["message"]
    with pytest.raises(grpc.RpcError) as err:
        stub.UnloadAdapter(pb.UnloadAdapterRequest(name="nope"), timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert _generate(stub, prompt, "qv") == want["qv"]  # still serving


def test_load_and_unload_under_concurrent_streams(setup):
    """Streams on both adapters and the base model while another adapter is loaded and unloaded
    over and over: every stream ends OK with its own tokens; one slot, so adapters take turns."""
    server, folders, prompt, want = setup
    stub = _stub(server)
    results: dict[int, list[int] | BaseException] = {}

    def stream(i: int, adapter: str) -> None:
        try:
            ids: list[int] = []
            for m in stub.GenerateStream(pb.GenerateStreamRequest(
                    prompt_token_ids=pb.TokenIds(ids=prompt), adapter=adapter,
                    sampling=pb.SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)), timeout=120):
                ids += m.token_ids
            results[i] = ids
        except BaseException as e:  # noqa: BLE001 - collected and asserted below
            results[i] = e

    if "mlp" not in {a.name for a in stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters}:
        stub.LoadAdapter(pb.LoadAdapterRequest(name="mlp", path=str(folders["mlp"])), timeout=30)
    plan = ["qv", "", "mlp", "qv", "", "mlp", "qv", "mlp"]
    threads = [threading.Thread(target=stream, args=(i, a)) for i, a in enumerate(plan)]
    for t in threads:
        t.start()
    for _ in range(3):
        stub.LoadAdapter(pb.LoadAdapterRequest(name="extra", path=str(folders["qv"])), timeout=30)
        stub.UnloadAdapter(pb.UnloadAdapterRequest(name="extra"), timeout=30)
    for t in threads:
        t.join(180)
    assert {i: r for i, r in results.items()} == {i: want[a or None] for i, a in enumerate(plan)}
    stub.UnloadAdapter(pb.UnloadAdapterRequest(name="mlp"), timeout=30)
    assert _http(server, "/v1/models/mlp", method="GET")[0] == 404
    core = server.core
    assert core.scheduler.num_running == 0 and core.block_manager.num_free_blocks == core.block_manager.num_total_blocks


def test_the_python_client_and_cli_name_the_adapter(setup):
    import subprocess
    import sys

    from pie_client import Client, NotFound

    server, _, prompt, want = setup
    with Client(server.address, timeout=120) as c:
        done = c.generate(prompt, adapter="qv", max_tokens=TOKENS, temperature=0, ignore_eos=True)
        assert list(done.token_ids) == want["qv"]
        with pytest.raises(NotFound, match="adapter 'nope': not loaded"):
            c.generate(prompt, adapter="nope", max_tokens=1)
    cli = subprocess.run([sys.executable, "-m", "pie_client", "--address", server.address, "generate", "hello",
                          "--adapter", "nope", "--max-tokens", "1"], capture_output=True, text=True, timeout=60)
    assert cli.returncode != 0 and "adapter 'nope': not loaded" in cli.stderr, cli
