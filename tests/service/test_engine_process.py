"""`pie serve --engine-process`: the engine in a spawned child process behind the same service.
The same answers as the in-process engine, validation in the parent, cancellation reaching the
child, and the child's faults, hangs and death turned into clear gRPC errors."""

from __future__ import annotations

import functools

import pytest

from pie.engine.config import EngineConfig
from pie.service.server import BackgroundServer, ServerConfig
from pie_client import Client, InvalidArgument, PieError
from tests.helpers import exit_process_after, fail_steps_after, hang_steps_after, make_hf_model_dir, wait_until

# slow: every test starts an engine process or a server
pytestmark = pytest.mark.slow

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("proc"), "llama", weight_scale=4.0)


def _config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", num_kv_blocks=NUM_BLOCKS,
                        max_num_seqs=8, max_num_batched_tokens=128, max_waiting=32)


@pytest.fixture(scope="module")
def servers(model_dir):
    with BackgroundServer(ServerConfig(port=0, grace_s=5), _config(model_dir)) as threaded, \
            BackgroundServer(ServerConfig(port=0, grace_s=5, engine_process=True), _config(model_dir)) as proc:
        yield threaded, proc


def test_same_answers_as_the_engine_thread(rng, servers):
    threaded, proc = servers
    prompts = [" ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat"]) for _ in range(rng.randrange(2, 20)))
               for _ in range(6)]
    with Client(threaded.address, timeout=60) as a, Client(proc.address, timeout=60) as b:
        for p in prompts:
            want = a.generate(p, max_tokens=12, temperature=0, ignore_eos=True)
            got = b.generate(p, max_tokens=12, temperature=0, ignore_eos=True)
            assert got.text == want.text and got.token_ids == want.token_ids
        seed = rng.randrange(2**31)
        want = a.generate("a cat", max_tokens=10, temperature=0.9, seed=seed, n=3)
        got = b.generate("a cat", max_tokens=10, temperature=0.9, seed=seed, n=3)
        assert [c.token_ids for c in got.choices] == [c.token_ids for c in want.choices]
        streamed = "".join(m.text for m in b.stream(prompts[0], max_tokens=12, temperature=0, ignore_eos=True))
        assert streamed == b.generate(prompts[0], max_tokens=12, temperature=0, ignore_eos=True).text
        info = b.model_info()
        assert info.load.kv_blocks_total == NUM_BLOCKS and info.architecture == "LlamaForCausalLM"
        assert b.tokenize("the cat").token_ids == a.tokenize("the cat").token_ids


def test_bad_input_is_refused_in_the_parent(servers):
    _, proc = servers
    with Client(proc.address, timeout=30) as c:
        with pytest.raises(InvalidArgument, match="max_tokens"):
            c.generate("the cat", max_tokens=10**6)
        with pytest.raises(InvalidArgument, match="prompt_token_ids"):
            c.generate([10**7], max_tokens=2)


def test_cancelled_streams_free_their_blocks_in_the_child(servers):
    _, proc = servers
    with Client(proc.address, timeout=60) as c:
        streams = [c.stream("the cat sat", max_tokens=200, ignore_eos=True) for _ in range(4)]
        for s in streams:
            next(s)
        for s in streams:
            s.close()

        def idle():
            load = c.model_info().load
            return load.kv_blocks_free == NUM_BLOCKS and load.requests_running == 0
        wait_until(idle, timeout=30, what="the child to free every block")
        assert proc.pie.engine_client.num_in_flight == 0


def test_a_step_fault_in_the_child_fails_only_its_requests(model_dir):
    cfg = ServerConfig(port=0, grace_s=2, engine_process=True,
                       engine_setup=functools.partial(fail_steps_after, n=3, error="injected fault"))
    with BackgroundServer(cfg, _config(model_dir)) as s, Client(s.address, timeout=60) as c:
        with pytest.raises(PieError, match="INTERNAL|search the server log"):
            c.generate("the cat", max_tokens=50, ignore_eos=True)
        # the engine process lives on: a later step fails again, but the service answers
        assert c.model_info().load.kv_blocks_total == NUM_BLOCKS


@pytest.mark.parametrize("how", ["exit", "hang"])
def test_a_dead_or_hung_engine_process_is_unavailable(model_dir, how):
    setup = (functools.partial(exit_process_after, n=2) if how == "exit"
             else functools.partial(hang_steps_after, n=2, seconds=30))
    cfg = ServerConfig(port=0, grace_s=1, engine_process=True, engine_setup=setup, step_timeout_s=1.0)
    with BackgroundServer(cfg, _config(model_dir)) as s, Client(s.address, timeout=60) as c:
        with pytest.raises(PieError) as err:
            c.generate("the cat", max_tokens=50, ignore_eos=True)
        assert err.value.code.name == "UNAVAILABLE"
        wait_until(lambda: s.pie.fatal.is_set(), timeout=10, what="the server to mark itself for exit")
        with pytest.raises(PieError) as err:
            c.generate("the cat", max_tokens=2)
        assert err.value.code.name == "UNAVAILABLE"


def test_cli_default_is_by_device():
    import argparse

    from pie.service import serve_config, serve_flags

    parser = argparse.ArgumentParser(prog="pie")
    serve_flags.add_serve_parser(parser.add_subparsers(dest="command", required=True))
    assert serve_config.server_config_from(parser.parse_args(["serve", "--device", "cpu"])).engine_process is True
    assert serve_config.server_config_from(parser.parse_args(["serve", "--device", "cpu", "--no-engine-process"])).engine_process is False
    assert serve_config.server_config_from(parser.parse_args(["serve", "--engine-process"])).engine_process is True


def test_messages_cross_the_pipe_unchanged():
    """What the engine process sends and its client receives (engine/messages.py, MessagePack):
    a step's result rebuilds equal, every field set away from its default, logprobs included; and
    so do the commands, their SamplingParams validated again on the way in."""
    from pie.engine.messages import (
        AbortRequest,
        AddRequest,
        EngineStats,
        RequestOutput,
        RequestStatus,
        SampledToken,
        StepResult,
        StopCore,
        decode_command,
        decode_result,
        encode,
    )
    from pie.engine.sampling_params import SamplingParams

    outs = [
        RequestOutput("a", [5, 6], "hi", [SampledToken(5, -0.5, [(5, -0.5), (9, -1.25)]), SampledToken(6, -2.0, [])],
                      finished=True, status=RequestStatus.FINISHED_STOPPED, stop_reason="\n", num_prompt_tokens=3,
                      num_output_tokens=7, queue_time_s=0.25, num_cached_tokens=16, index=2, all_finished=False),
        RequestOutput("b", [], "", finished=True, status=RequestStatus.FINISHED_ERROR, error="boom", all_finished=True,
                      out_of_memory=True),
        RequestOutput("c", [1], " x", stop_reason=7),
    ]
    result = StepResult(outs, EngineStats(64, 60, 2, 1, 30, 16, 1, 3), steps=12, taken=5)
    back = decode_result(encode(result))
    assert back == result
    assert isinstance(back.outputs[0].status, RequestStatus)
    assert isinstance(back.outputs[0].new_logprobs[0], SampledToken)
    assert back.outputs[0].new_logprobs[0].top == [(5, -0.5), (9, -1.25)]
    sampling = SamplingParams(max_tokens=9, temperature=0.5, stop=["x"], seed=3, n=2, logprobs=4)
    for cmd in (AddRequest("r1", [1, 2, 3], sampling), AbortRequest("r1"), StopCore()):
        assert decode_command(encode(cmd)) == cmd


def test_a_setup_function_of_the_main_script_reaches_the_engine_process(model_dir, tmp_path):
    """As with multiprocessing: functions defined in the parent's __main__ (a benchmark or a user's
    script) unpickle in the engine process, whose start loads that script as __mp_main__."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "serve_script.py"
    script.write_text(f'''
import sys
sys.path[:0] = [{str(root)!r}, {str(root / "clients")!r}]
from pie.engine.config import EngineConfig
from pie_client import Client
from pie.service.server import BackgroundServer, ServerConfig

def fixed_seed(engine):  # defined in __main__: pickled by reference
    engine.config.seed = 1234

if __name__ == "__main__":
    cfg = EngineConfig(model={str(model_dir)!r}, device="cpu", kv_cache_dtype="fp32", num_kv_blocks=16)
    with BackgroundServer(ServerConfig(port=0, engine_process=True, engine_setup=fixed_seed), cfg) as s:
        with Client(s.address, timeout=60) as c:
            print("tokens", c.generate("the cat", max_tokens=3, ignore_eos=True).completion_tokens)
''')
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokens 3" in done.stdout


@pytest.mark.skipif(not hasattr(__import__("signal"), "SIGSTOP"), reason="needs SIGSTOP")
def test_a_stalled_engine_process_never_blocks_the_event_loop(rng, model_dir):
    """Stop the engine process outright (as a device call that holds its interpreter would) and
    send more commands than the pipe holds: they queue in the parent's sender thread, health
    checks keep answering at once, and once the process runs again every request is served."""
    import asyncio
    import os
    import signal
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pie.service.servicer import SERVICE_NAME
    from pie.v1 import generate_pb2 as pb
    from pie.v1 import generate_pb2_grpc as pb_grpc

    cfg = _config(model_dir)
    cfg.max_waiting, cfg.num_kv_blocks = 512, 512
    with BackgroundServer(ServerConfig(port=0, grace_s=5, engine_process=True), cfg) as s:
        child = s.pie.engine_client.pid
        n, prompt_len = 300, 480  # ~300 x 2 KB of pickled commands: more than a socket buffer holds
        os.kill(child, signal.SIGSTOP)
        try:
            async def scenario():
                async with grpc.aio.insecure_channel(s.address) as ch:
                    stub = pb_grpc.GenerateServiceStub(ch)
                    health = health_pb2_grpc.HealthStub(ch)
                    calls = [stub.Generate(pb.GenerateRequest(
                        prompt_token_ids=pb.TokenIds(ids=[rng.randrange(3, 500) for _ in range(prompt_len)]),
                        sampling=pb.SamplingParams(max_tokens=1, ignore_eos=True)), timeout=300) for _ in range(n)]
                    tasks = [asyncio.ensure_future(c) for c in calls]
                    deadline = time.monotonic() + 60
                    while s.pie.engine_client.num_in_flight < n:  # every request accepted, none served
                        assert time.monotonic() < deadline, f"{s.pie.engine_client.num_in_flight} of {n} accepted"
                        await asyncio.sleep(0.05)
                    worst = 0.0
                    for _ in range(20):
                        t = time.perf_counter()
                        await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
                        worst = max(worst, time.perf_counter() - t)
                    os.kill(child, signal.SIGCONT)
                    results = await asyncio.gather(*tasks)
                    return worst, results

            worst, results = asyncio.run(scenario())
        finally:
            os.kill(child, signal.SIGCONT)
        assert worst < 0.5, f"a health check took {worst:.2f} s while the engine process was stopped"
        assert all(r.usage.completion_tokens == 1 for r in results)
