"""The request options vLLM's and SGLang's gRPC callers bring, end to end through a real server and
the bundled client: prompt logprobs (against transformers), logit_bias, min_tokens, the logprobs
mode, Detokenize, and Abort by request id across connections, processes and bearer tokens."""

from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import sys
import threading

import pytest
import torch

from pie.engine.config import EngineConfig
from pie.service.server import BackgroundServer, ServerConfig
from pie_client import AsyncClient, Cancelled, Client, InvalidArgument
from tests.helpers import BOS_ID, EOS_ID, StepGate, make_hf_model_dir, wait_until

pytestmark = pytest.mark.slow

NUM_BLOCKS = 64
TOLERANCE = 1e-3
# One connection per Client: without it, gRPC Python shares one connection between channels to the
# same target, and two clients of one process would be one caller to the server.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("llama"), "llama", weight_scale=4.0)


@pytest.fixture(scope="module")
def hf(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def engine_config(model_dir, **kw) -> EngineConfig:
    return EngineConfig(**{**dict(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", num_kv_blocks=NUM_BLOCKS,
                                  max_num_seqs=8, max_num_batched_tokens=32), **kw})  # long prompts: several chunks


@pytest.fixture(scope="module")
def gate() -> StepGate:
    return StepGate()


@pytest.fixture(scope="module")
def server(model_dir, gate):
    with BackgroundServer(ServerConfig(port=0, grace_s=2, engine_setup=gate), engine_config(model_dir)) as s:
        yield s


@pytest.fixture()
def client(server):
    with Client(server.address, timeout=60, options=OWN_CONNECTION) as c:
        yield c


def check_prompt_logprobs(hf, prompt: list[int], got, k: int) -> None:
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    assert [e.token_id for e in got] == prompt
    assert got[0].logprob is None and got[0].top_logprobs == []
    for i, e in enumerate(got[1:], start=1):
        assert abs(e.logprob - ref[i - 1, prompt[i]].item()) < TOLERANCE, i
        assert len(e.top_logprobs) == k
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(ref[i - 1].topk(k).values.tolist(), abs=TOLERANCE)
        for t in e.top_logprobs:
            assert abs(t.logprob - ref[i - 1, t.token_id].item()) < TOLERANCE


# ---- prompt logprobs, logit_bias, min_tokens, logprobs mode ------------------------------------------

def test_prompt_logprobs_unary_and_stream_match_transformers(client, hf, server, rng):
    prompt = [rng.randrange(3, 512) for _ in range(70)]  # 3 chunks of at most 32 tokens
    client.generate(prompt, max_tokens=1)  # its blocks are cached now: the next call must not use them
    done = client.generate(prompt, max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=4)
    assert done.cached_prompt_tokens == 0
    check_prompt_logprobs(hf, prompt, done.prompt_logprobs, 4)
    deltas = list(client.stream(prompt, max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=4))
    assert deltas[0].prompt_logprobs == done.prompt_logprobs and deltas[0].token_ids
    assert all(d.prompt_logprobs == [] for d in deltas[1:])
    assert [t for d in deltas for t in d.token_ids] == done.token_ids
    plain = client.generate(prompt, max_tokens=4, temperature=0, ignore_eos=True)
    assert plain.prompt_logprobs == [] and plain.token_ids == done.token_ids and plain.cached_prompt_tokens == 64
    # A text prompt: the server's special tokens included; 0 asks for the prompt tokens' own only.
    text = client.generate("Once upon a time", max_tokens=1, prompt_logprobs=0)
    ids = client.tokenize("Once upon a time").token_ids
    assert ids[0] == BOS_ID
    check_prompt_logprobs(hf, ids, text.prompt_logprobs, 0)


def test_many_prompt_logprobs_are_built_off_the_event_loop_alike(client, hf, rng):
    """300 positions x 21 entries: past INLINE_LOGPROB_ENTRIES, so the messages are built on a
    worker thread, for the unary answer and the first stream message alike."""
    prompt = [rng.randrange(3, 512) for _ in range(300)]
    done = client.generate(prompt, max_tokens=1, prompt_logprobs=20)
    check_prompt_logprobs(hf, prompt, done.prompt_logprobs, 20)
    first = next(iter(client.stream(prompt, max_tokens=1, prompt_logprobs=20)))
    assert first.prompt_logprobs == done.prompt_logprobs


def test_prompt_logprobs_with_n_samples_come_once(client, hf, rng):
    prompt = [rng.randrange(3, 512) for _ in range(20)]
    done = client.generate(prompt, max_tokens=3, temperature=1.0, seed=3, n=2, prompt_logprobs=1, ignore_eos=True)
    check_prompt_logprobs(hf, prompt, done.prompt_logprobs, 1)
    deltas = list(client.stream(prompt, max_tokens=3, temperature=1.0, seed=3, n=2, prompt_logprobs=1,
                                ignore_eos=True))
    carrying = [d for d in deltas if d.prompt_logprobs]
    assert len(carrying) == 1 and carrying[0] is deltas[0] and carrying[0].index == 0
    assert carrying[0].prompt_logprobs == done.prompt_logprobs


def test_logit_bias_and_min_tokens(client, rng):
    prompt = [rng.randrange(3, 512) for _ in range(10)]
    forced = client.generate(prompt, max_tokens=5, temperature=0.9, seed=1, ignore_eos=True, logit_bias={42: 100.0})
    assert forced.token_ids == [42] * 5
    banned = client.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True)
    first = banned.token_ids[0]
    again = client.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True, logit_bias={first: -100.0})
    assert first not in again.token_ids
    ends = client.generate(prompt, max_tokens=20, temperature=0, min_tokens=6, logit_bias={EOS_ID: 100.0})
    assert (ends.finish_reason, len(ends.token_ids), ends.token_ids[-1]) == ("stop", 7, EOS_ID)
    assert EOS_ID not in ends.token_ids[:6]
    streamed = [t for d in client.stream(prompt, max_tokens=20, temperature=0, min_tokens=6,
                                         logit_bias={EOS_ID: 100.0}) for t in d.token_ids]
    assert streamed == ends.token_ids
    # A stop string met before min_tokens does not end it.
    text = client.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True).text
    assert len(text) >= 4
    early = client.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True, stop=[text[:2]])
    late = client.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True, stop=[text[:2]], min_tokens=12)
    assert early.finish_reason == "stop" and early.text == ""
    assert late.text.startswith(text[:2]) and len(late.token_ids) == 12


def test_raw_and_processed_logprobs_modes(model_dir, client, server):
    """raw (the default): log_softmax of the model's logits, whatever the sampling; processed: of
    the logits the token was chosen from (here: a temperature and a top-k of 2)."""
    assert client.model_info().logprobs_mode == "raw"
    kw = dict(max_tokens=6, temperature=0.5, top_k=2, seed=9, ignore_eos=True, logprobs=3)
    raw = client.generate([5, 6, 7, 8], **kw)
    cfg = engine_config(model_dir, logprobs_mode="processed")
    with BackgroundServer(ServerConfig(port=0, grace_s=1), cfg) as s, Client(s.address, timeout=60) as c:
        assert c.model_info().logprobs_mode == "processed"
        processed = c.generate([5, 6, 7, 8], **kw)
    assert processed.token_ids == raw.token_ids  # the same draws, reported differently
    for r, p in zip(raw.logprobs, processed.logprobs):
        # Over the two tokens top_k keeps, at temperature 0.5: from their raw logprobs (the raw
        # log-normalizer cancels out of the renormalized distribution).
        kept = torch.tensor([t.logprob for t in r.top_logprobs[:2]], dtype=torch.float64) / 0.5
        expected = (kept - torch.logsumexp(kept, 0)).tolist()
        assert [t.token_id for t in p.top_logprobs[:2]] == [t.token_id for t in r.top_logprobs[:2]]
        assert [t.logprob for t in p.top_logprobs[:2]] == pytest.approx(expected, abs=1e-4)
        assert p.logprob == pytest.approx(expected[[t.token_id for t in r.top_logprobs].index(p.token_id)], abs=1e-4)
        assert p.top_logprobs[2].logprob == float("-inf")  # top_k=2 removed the third


# ---- Detokenize ----------------------------------------------------------------------------------------

def test_detokenize(client, server):
    text = "Once upon a time, a café"
    ids = client.tokenize(text).token_ids
    assert ids[0] == BOS_ID
    assert client.detokenize(ids) == server.core.tokenizer.decode(ids) == text
    assert client.detokenize(ids, skip_special_tokens=False) == "<s>" + text
    assert client.detokenize([]) == ""
    for bad in ([1, 2, 512], [10**6]):
        with pytest.raises(InvalidArgument) as err:
            client.detokenize(bad)
        assert [f for f, _ in err.value.field_violations] == ["token_ids"]


# ---- Abort ---------------------------------------------------------------------------------------------

def _stream_in_thread(c: Client, request_id: str, **kw) -> tuple[cf.Future, threading.Event]:
    """Streams in a thread; the event is set once the first delta arrived. The future's result:
    ("done", deltas) or ("cancelled", the Cancelled error)."""
    first = threading.Event()

    def run():
        deltas = []
        try:
            for d in c.stream("a b c d", request_id=request_id, max_tokens=400, ignore_eos=True, **kw):
                deltas.append(d)
                first.set()
            return "done", deltas
        except Cancelled as error:
            first.set()
            return "cancelled", error

    return cf.ThreadPoolExecutor(1).submit(run), first


def _start_streams(server, gate: StepGate, callers: list[tuple[Client, str]]) -> list[cf.Future]:
    """With the gate held and no request in the engine: starts a stream per (client, request id),
    one after another, each until its first token, so that every step after waits for a permit.
    The first one's AddRequest starts a step that waits; each later one's is taken in after the
    step under way (a permit), and its prefill is the next (another)."""
    in_flight = server.pie.admission.in_flight
    futures = []
    for k, (c, rid) in enumerate(callers, start=1):
        future, started = _stream_in_thread(c, rid)
        wait_until(lambda: len(in_flight) == k, what=f"request {k} in the engine")  # noqa: B023
        gate.allow(1 if k == 1 else 2)
        assert started.wait(30), f"stream {k} got no first token"
        futures.append(future)
    return futures


def _free_within_one_step(server, gate: StepGate, c: Client) -> None:
    """The step under way finishes (one permit); the aborts are applied before any other. Both
    conditions are waited for together: GetModelInfo's load is a snapshot, which can still be one
    from before the request took its blocks (all free) while the engine has not applied the abort
    yet; with one permit, an abort left for a later step never shows both."""
    gate.allow(1)
    wait_until(lambda: (c.model_info().load.kv_blocks_free == NUM_BLOCKS  # noqa: B023
                        and server.core.scheduler.num_running == 0), what="the aborted requests' blocks back")


def test_abort_without_tokens_reaches_the_request_from_any_connection(server, gate):
    """Without tokens every caller is the anonymous one (vLLM's and SGLang's abort by id): a third
    connection ends the request it names and only that one. The aborted stream ends CANCELLED
    (REQUEST_ABORTED), again is a no-op, and the blocks are free within one step."""
    admission = server.pie.admission
    with Client(server.address, timeout=60, options=OWN_CONNECTION) as a, \
            Client(server.address, timeout=60, options=OWN_CONNECTION) as b, \
            Client(server.address, timeout=60, options=OWN_CONNECTION) as third:
        gate.hold()
        try:
            fa, fb = _start_streams(server, gate, [(a, "job-1"), (b, "job-2")])
            assert third.abort(["job-2", "job-3"]) == ["job-2"]
            kind, error = fb.result(30)
            assert kind == "cancelled" and error.reason == "REQUEST_ABORTED" and error.request_id == "job-2"
            assert not fa.done()  # the request under another id runs on
            assert third.abort("job-2") == [] and a.abort("job-9") == []  # idempotent; an unknown id
            assert b.abort(["job-1", "job-1"]) == ["job-1"]
            kind, error = fa.result(30)
            assert kind == "cancelled" and error.reason == "REQUEST_ABORTED"
            _free_within_one_step(server, gate, a)
        finally:
            gate.release()
    assert len(admission.in_flight) == 0


def test_pie_client_abort_from_another_process(server, gate):
    """docs/clients.md's `pie-client abort ID`: one process streams under a request id, another
    aborts it by that id; the stream ends CANCELLED (exit 1) and the KV blocks are free."""
    cli = [sys.executable, "-m", "pie_client", "--address", server.address]
    gate.hold()
    streaming = subprocess.Popen([*cli, "--request-id", "cli-job", "generate", "a b c d", "--max-tokens", "400",
                                  "--ignore-eos"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: len(server.pie.admission.in_flight) == 1, timeout=60, what="the stream in the engine")
        gate.allow(1)  # its prefill: the first token goes out
        abort = subprocess.run([*cli, "abort", "cli-job"], capture_output=True, text=True, timeout=60)
        assert abort.returncode == 0 and json.loads(abort.stdout) == {"aborted_request_ids": ["cli-job"]}, abort
        _, err = streaming.communicate(timeout=60)
        assert streaming.returncode == 1 and err.startswith("pie-client: CANCELLED: ") and "cli-job" in err, err
        with Client(server.address, timeout=60) as c:
            _free_within_one_step(server, gate, c)
    finally:
        gate.release()
        if streaming.poll() is None:
            streaming.kill()
            streaming.wait()
    assert len(server.pie.admission.in_flight) == 0


def test_abort_with_tokens_is_per_token_not_per_connection(model_dir, tmp_path):
    """With --auth-token-file, the caller is its token: another connection with the same token
    aborts the request, a connection with another token cannot, though it runs a request of its own
    under the same id."""
    gate = StepGate()
    cfg = ServerConfig(port=0, grace_s=2, auth_tokens=("token-a", "token-b"), engine_setup=gate)
    with BackgroundServer(cfg, engine_config(model_dir)) as s, \
            Client(s.address, timeout=60, token="token-a", options=OWN_CONNECTION) as a, \
            Client(s.address, timeout=60, token="token-a", options=OWN_CONNECTION) as a_elsewhere, \
            Client(s.address, timeout=60, token="token-b", options=OWN_CONNECTION) as b, \
            Client(s.address, timeout=60, token="token-b", options=OWN_CONNECTION) as b_elsewhere:
        gate.hold()
        try:
            fa, fb = _start_streams(s, gate, [(a, "job"), (b, "job")])
            assert a_elsewhere.abort("job") == ["job"]
            kind, error = fa.result(30)
            assert kind == "cancelled" and error.reason == "REQUEST_ABORTED"
            assert not fb.done()  # token-b's request under the same id runs on
            assert a.abort("job") == []  # token-a has no other
            assert b_elsewhere.abort("job") == ["job"]
            kind, error = fb.result(30)
            assert kind == "cancelled" and error.reason == "REQUEST_ABORTED"
            _free_within_one_step(s, gate, a)
        finally:
            gate.release()


def test_abort_a_unary_call_and_n_samples(server, gate, client):
    gate.hold()
    try:
        done = cf.ThreadPoolExecutor(1).submit(
            lambda: client.generate("a b", request_id="unary-1", max_tokens=400, ignore_eos=True, n=3,
                                    temperature=1.0))
        wait_until(lambda: len(server.pie.admission.in_flight) == 1, what="the request in the engine")
        gate.allow(2)  # sample 0's prefill, then the others from the cache
        assert client.abort("unary-1") == ["unary-1"]
        with pytest.raises(Cancelled) as err:
            done.result(30)
        assert err.value.reason == "REQUEST_ABORTED"
        _free_within_one_step(server, gate, client)
    finally:
        gate.release()


def test_abort_refuses_bad_ids(client):
    for bad in ([], [""], ["x" * 129], ["caf\u00e9"], ["ok"] * 1025):
        with pytest.raises(InvalidArgument) as err:
            client.abort(bad)
        assert [f for f, _ in err.value.field_violations] == ["request_ids"], bad


def test_async_client_abort_and_detokenize(server):
    import asyncio

    async def main():
        async with AsyncClient(server.address, timeout=60, options=OWN_CONNECTION) as c:
            stream = c.stream("a b", request_id="aio-1", max_tokens=400, ignore_eos=True)
            first = await stream.__anext__()
            assert first.token_ids
            assert await c.abort("aio-1") == ["aio-1"]
            with pytest.raises(Cancelled):
                async for _ in stream:
                    pass
            return await c.detokenize([BOS_ID, 40, 41], skip_special_tokens=False)

    text = asyncio.run(main())
    assert text.startswith("<s>")
