"""End to end: a real grpc.aio server on a loopback port, called through the bundled client."""

from __future__ import annotations

import concurrent.futures as cf
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pie.engine.config import EngineConfig
from pie.service.server import BackgroundServer, ServerConfig
from pie.service.servicer import SERVICE_NAME
from pie_client import Client, DeadlineExceeded, InvalidArgument, ResourceExhausted
from tests.helpers import StepGate, make_hf_model_dir, wait_until

# slow: every test calls a BackgroundServer
pytestmark = pytest.mark.slow

NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("llama"), "llama", weight_scale=4.0)


@pytest.fixture(scope="module")
def server(model_dir):
    cfg = EngineConfig(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", block_size=16,
                       num_kv_blocks=NUM_BLOCKS, max_num_seqs=16, max_num_batched_tokens=256, max_waiting=64)
    with BackgroundServer(ServerConfig(port=0, grace_s=5), cfg) as s:
        yield s


@pytest.fixture()
def client(server):
    with Client(server.address, timeout=60) as c:
        yield c


def test_model_info_and_tokenize(client, server):
    info = client.model_info()
    assert info.architecture == "LlamaForCausalLM"
    assert info.kv_cache_dtype == "fp32"
    assert info.block_size == 16
    assert info.load.kv_blocks_total == NUM_BLOCKS
    assert info.load.kv_blocks_free == NUM_BLOCKS
    assert info.vocab_size == server.core.vocab_size
    assert info.eos_token_ids == list(server.core.eos_token_ids)
    tok = client.tokenize("Once upon a time")
    assert tok.token_ids == server.core.tokenizer.encode("Once upon a time")
    # Each token's text piece (not its byte-level vocabulary spelling, "Ġupon"): together the text.
    assert "".join(tok.tokens) == server.core.tokenizer.decode(tok.token_ids, skip_special_tokens=False)
    assert "".join(tok.tokens).endswith("Once upon a time") and len(tok.tokens) == len(tok.token_ids)


def test_streams_equal_unary(rng, client):
    """16 concurrent streams, each with its own seed; each stream's text equals the unary answer."""
    prompts = [" ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat", "and", "dog"]) for _ in range(rng.randrange(2, 30)))
               for _ in range(16)]
    kwargs = [dict(max_tokens=rng.randrange(8, 40), temperature=0.9, top_p=0.95, top_k=50, seed=rng.randrange(2**31),
                   ignore_eos=True) for _ in range(16)]

    def run_stream(i):
        deltas = list(client.stream(prompts[i], **kwargs[i]))
        return deltas

    with cf.ThreadPoolExecutor(16) as pool:
        streamed = list(pool.map(run_stream, range(16)))
    for i, deltas in enumerate(streamed):
        unary = client.generate(prompts[i], **kwargs[i])
        assert "".join(d.text for d in deltas) == unary.text
        assert [t for d in deltas for t in d.token_ids] == unary.token_ids
        assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == kwargs[i]["max_tokens"]
        assert all(d.finish_reason is None for d in deltas[:-1])


def test_cancelled_stream_and_deadline_free_blocks(client, server):
    free_before = client.model_info().load.kv_blocks_free
    it = client.stream("a b c d e f", max_tokens=500, ignore_eos=True, temperature=0)
    next(it)
    next(it)
    it.close()  # cancels the RPC
    wait_until(lambda: client.model_info().load.kv_blocks_free == free_before, what="blocks back after cancel")
    # An expired deadline mid-generation: time a full run first so the deadline surely falls inside one.
    t0 = time.monotonic()
    client.generate("a b c d e f", max_tokens=480, ignore_eos=True)
    full_s = time.monotonic() - t0
    with pytest.raises(DeadlineExceeded):
        for _ in client.stream("a b c d e f", max_tokens=480, ignore_eos=True, timeout=full_s / 3):
            pass
    wait_until(lambda: client.model_info().load.kv_blocks_free == free_before, what="blocks back after deadline")
    info = client.model_info()
    assert info.load.requests_running == 0 and info.load.requests_waiting == 0


BAD_INPUTS = [
    ("prompt", dict(prompt="")),
    ("prompt_token_ids", dict(prompt=[])),
    ("prompt_token_ids", dict(prompt=[1, 2, 10_000_000])),
    ("prompt", dict(prompt=[1] * 5000)),
    ("sampling.max_tokens", dict(max_tokens=100_000)),
    ("sampling.max_tokens", dict(prompt=[1] * 200, max_tokens=400)),
    ("sampling.temperature", dict(temperature=-1.0)),
    ("sampling.temperature", dict(temperature=float("nan"))),
    ("sampling.top_k", dict(top_k=10**6)),
    ("sampling.top_p", dict(top_p=0.0)),
    ("sampling.top_p", dict(top_p=1.5)),
    ("sampling.min_p", dict(min_p=2.0)),
    ("sampling.repetition_penalty", dict(repetition_penalty=0.0)),
    ("sampling.repetition_penalty", dict(repetition_penalty=float("inf"))),
    ("sampling.presence_penalty", dict(presence_penalty=3.0)),
    ("sampling.frequency_penalty", dict(frequency_penalty=-5.0)),
    ("sampling.seed", dict(seed=2**64 - 1)),
    ("sampling.stop", dict(stop=[""])),
    ("sampling.stop", dict(stop=["x"] * 100)),
    ("sampling.stop", dict(stop=["x" * 1000])),
    ("sampling.stop_token_ids", dict(stop_token_ids=[10**7])),
    ("sampling.logprobs", dict(logprobs=1000)),
    ("sampling.prompt_logprobs", dict(prompt_logprobs=21)),
    ("sampling.logit_bias", dict(logit_bias={10**6: 1.0})),
    ("sampling.logit_bias", dict(logit_bias={5: 1000.0})),
    ("sampling.logit_bias", dict(logit_bias={5: float("nan")})),
    ("sampling.logit_bias", dict(logit_bias={i: 1.0 for i in range(1025)})),
    ("sampling.min_tokens", dict(max_tokens=4, min_tokens=5)),
]


@pytest.mark.parametrize("field,kwargs", BAD_INPUTS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_INPUTS)])
def test_bad_input_names_field(client, field, kwargs):
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", "hello there")
    with pytest.raises(InvalidArgument) as err:
        client.generate(prompt, **kwargs)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in [f for f, _ in err.value.field_violations], err.value
    too_long = field == "prompt" and len(prompt) > 100  # more tokens than the context holds
    assert err.value.reason == ("PROMPT_TOO_LONG" if too_long else "INVALID_FIELD"), err.value
    with pytest.raises(InvalidArgument):
        list(client.stream(prompt, **kwargs))
    # ... and the server keeps serving everyone else.
    assert client.generate("hello", max_tokens=2, ignore_eos=True).completion_tokens == 2


def test_request_id_round_trip(client):
    out = client.generate("hello", max_tokens=2, request_id="my-id-42")
    assert out.request_id == "my-id-42"
    with pytest.raises(InvalidArgument) as err:
        client.generate("", request_id="bad-id-7")
    assert err.value.request_id == "bad-id-7"


def test_stop_string_and_logprobs(client):
    base = client.generate("the cat", max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)
    assert len(base.logprobs) == len(base.token_ids)
    for lp in base.logprobs:
        assert len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[-1].logprob
        assert lp.logprob <= lp.top_logprobs[0].logprob + 1e-5
    text = base.text
    assert len(text) >= 6, text  # 24 tokens of the bundled model's stories
    stop = text[3:6]
    cut = client.generate("the cat", max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[:text.index(stop)]


def test_health_readiness(server):
    with grpc.insecure_channel(server.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        assert stub.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
        assert stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME)).status == \
            health_pb2.HealthCheckResponse.SERVING


def test_queue_bound_resource_exhausted(model_dir):
    cfg = EngineConfig(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", num_kv_blocks=32,
                       max_num_seqs=1, max_waiting=1)
    with BackgroundServer(ServerConfig(port=0, grace_s=1), cfg) as s, Client(s.address, timeout=60) as c:
        first = c.stream("a b c", max_tokens=400, ignore_eos=True)
        next(first)  # running
        second = c.stream("d e f", max_tokens=4, ignore_eos=True)
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(lambda: list(second))
            wait_until(lambda: c.model_info().load.requests_waiting == 1, what="one waiting request")
            with pytest.raises(ResourceExhausted) as err:
                c.generate("g h i", max_tokens=4)
            assert err.value.reason == "QUEUE_FULL" and err.value.retry_after == 1.0
            first.close()
            assert fut.result(timeout=60)[-1].finish_reason == "length"


def test_reflection_lists_and_describes_services(server):
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(server.address) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = set(db.get_services())
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= services
        pool = DescriptorPool(db)
        svc = pool.FindServiceByName(SERVICE_NAME)
        assert {m.name for m in svc.methods} == {"Generate", "GenerateStream", "Tokenize", "GetModelInfo", "Abort",
                                                 "Detokenize", "LoadAdapter", "UnloadAdapter", "ListAdapters"}
        sampling = pool.FindMessageTypeByName("pie.v1.SamplingParams")
        assert "repetition_penalty" in sampling.fields_by_name


def test_not_serving_until_loaded(model_dir):
    """Readiness is NOT_SERVING and RPCs answer UNAVAILABLE while the model is not loaded yet."""
    import asyncio

    from pie.service.server import PieServer
    from pie_client import Unavailable

    cfg = EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=8)
    loop = asyncio.new_event_loop()
    pie = PieServer(ServerConfig(port=0), cfg)
    try:
        port = loop.run_until_complete(pie.start())
        address = f"127.0.0.1:{port}"

        async def check():
            async with grpc.aio.insecure_channel(address) as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                live = await stub.Check(health_pb2.HealthCheckRequest(service=""))
                ready = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
                return live.status, ready.status

        live, ready = loop.run_until_complete(check())
        assert live == health_pb2.HealthCheckResponse.SERVING
        assert ready == health_pb2.HealthCheckResponse.NOT_SERVING
        fut = cf.ThreadPoolExecutor(1).submit(lambda: Client(address, timeout=10).generate("hi", max_tokens=1))
        while not fut.done():
            loop.run_until_complete(asyncio.sleep(0.01))
        with pytest.raises(Unavailable) as err:
            fut.result()
        assert err.value.reason == "MODEL_LOADING" and err.value.retry_after == 5.0
    finally:
        loop.run_until_complete(pie.stop(0))
        loop.close()


def test_n_samples_unary_and_stream(client):
    """n choices: reproducible with a seed, distinct from each other, the stream tags each delta with
    its choice index and its per-choice text equals the unary answer's."""
    kw = dict(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True, n=3)
    first = client.generate("the cat sat on", **kw)
    again = client.generate("the cat sat on", **kw)
    assert [c.token_ids for c in first.choices] == [c.token_ids for c in again.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in first.choices}) > 1, "samples with different seeds differ"
    assert first.text == first.choices[0].text and first.token_ids == first.choices[0].token_ids
    assert first.completion_tokens == 3 * 12
    texts, finished = {0: "", 1: "", 2: ""}, set()
    deltas = list(client.stream("the cat sat on", **kw))
    for d in deltas:
        texts[d.index] += d.text
        if d.finish_reason is not None:
            finished.add(d.index)
    assert finished == {0, 1, 2}
    assert texts == {c.index: c.text for c in first.choices}
    assert deltas[-1].usage is not None and deltas[-1].usage.completion_tokens == 36
    assert all(d.usage is None for d in deltas[:-1])


def test_prefix_cache_reported_in_usage(client, server):
    prompt = list(range(3, 3 + 40))  # 2 full blocks of 16 + 8
    client.generate(prompt, max_tokens=2, temperature=0)
    out = client.generate(prompt, max_tokens=2, temperature=0)
    assert out.cached_prompt_tokens == 32
    # Finished, the prompt's full blocks stay cached: free, and counted as such.
    load = client.model_info().load
    assert load.kv_blocks_free == load.kv_blocks_total
    assert load.kv_blocks_cached == server.core.stats().kv_blocks_cached >= 2


def test_stop_string_completed_by_the_last_token(client):
    """A stop string completed by the request's last allowed token ends it as "stop", cut."""
    # The shortest suffix (2 characters or more) that first appears at the very end: only the last
    # token completes it. The whole text always qualifies, so a random model cannot make this fail.
    prompt = "the cat"
    text = client.generate(prompt, max_tokens=10, temperature=0, ignore_eos=True).text
    assert len(text) >= 2
    stop = next(text[-k:] for k in range(2, len(text) + 1) if text.index(text[-k:]) == len(text) - k)
    cut = client.generate(prompt, max_tokens=10, temperature=0, ignore_eos=True, stop=[stop])
    assert (cut.finish_reason, cut.stop_reason, cut.text) == ("stop", stop, text[:-len(stop)])


def test_stream_interval_sends_fewer_larger_messages(model_dir):
    """--stream-interval 4: the first token alone (TTFT unchanged), then at least 4 tokens per
    message until the last; the text is the same as the unary answer's. The test holds the engine
    after its first step until that token has arrived (an engine faster than the loop may coalesce
    even the first message, which is right but not what this checks)."""
    cfg = EngineConfig(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", num_kv_blocks=NUM_BLOCKS,
                       max_num_seqs=4)
    gate = StepGate()
    with BackgroundServer(ServerConfig(port=0, grace_s=1, stream_interval=4, engine_setup=gate), cfg) as s, \
            Client(s.address, timeout=60) as c:
        for n in (1, 2):
            gate.hold()
            gate.allow(1)  # the prefill: one token (sample 1 of n = 2 waits for sample 0's prompt)
            it = c.stream("the cat sat", max_tokens=23, temperature=0, ignore_eos=True, n=n)
            first = next(it)
            gate.release()
            deltas = [first, *it]
            per_choice: dict[int, list] = {}
            for d in deltas:
                per_choice.setdefault(d.index, []).append(d)
            assert len(per_choice) == n
            assert len(first.token_ids) == 1
            for ds in per_choice.values():  # between the first and the last: >= 4 tokens each (n tokens per step)
                assert all(len(d.token_ids) >= 4 for d in ds[1:-1]), [len(d.token_ids) for d in ds]
            assert len(deltas) <= n * (2 + 23 // 4)  # against 23 * n with an interval of 1
            unary = c.generate("the cat sat", max_tokens=23, temperature=0, ignore_eos=True, n=n)
            texts = {i: "".join(d.text for d in ds) for i, ds in per_choice.items()}
            assert texts == ({0: unary.text} if n == 1 else {ch.index: ch.text for ch in unary.choices})
    with pytest.raises(ValueError, match="stream_interval"):
        BackgroundServer(ServerConfig(port=0, stream_interval=0), cfg)


def test_the_http_door_loads_only_with_its_port(tmp_path):
    """A gRPC-only server imports neither FastAPI nor uvicorn (a fresh interpreter: what `pie serve`
    without --http-port loads); with --http-port it has its door."""
    import subprocess
    import sys

    code = ("import sys; from pie.engine.config import EngineConfig; "
            "from pie.service.server import PieServer, ServerConfig; "
            f"s = PieServer(ServerConfig(), EngineConfig(model={str(tmp_path)!r})); "
            "assert s.http is None; assert not {'fastapi', 'uvicorn'} & set(sys.modules), sorted(sys.modules); "
            f"s = PieServer(ServerConfig(http_port=0), EngineConfig(model={str(tmp_path)!r})); "
            "assert s.http is not None and 'fastapi' in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
