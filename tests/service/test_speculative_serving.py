"""Speculative decoding from the service's side: `pie serve --speculative ...` flags into
EngineConfig (and one-line refusals of bad combinations), SamplingParams.disable_speculation from
the proto, the spec_decode metrics and the request_done fields, and end to end over gRPC: a server
started from `--speculative ngram` answers as a server without it, counts its drafts, and a request
with disable_speculation makes none."""

from __future__ import annotations

import urllib.request

import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from pie.engine.config import EngineConfig
from pie.engine.messages import EngineStats
from pie.service import cli, serve_config
from pie.service.logging import RequestSummary
from pie.service.metrics import ServiceMetrics
from pie.service.server import BackgroundServer
from pie.service.validation import sampling_from_proto
from pie.v1 import generate_pb2 as pb
from pie_client import Client
from tests.helpers import make_hf_model_dir

MODEL = "spec-model"
K = 4  # proposals per step of the speculating server


# ---- flags ------------------------------------------------------------------------------------------
def _args(*flags: str):
    return cli.build_parser().parse_args(["serve", *flags])


def _refusal(capsys, *flags: str) -> str:
    """`pie serve FLAGS`' one line (without its prefix), refused before anything starts."""
    assert cli._serve(_args(*flags), None) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pie serve: error: ") and "Traceback" not in err, err
    return err.removeprefix("pie serve: error: ").rstrip("\n")


def test_speculative_flags_reach_the_engine_config():
    off = serve_config.engine_config_from(_args())
    assert off.speculative is None and off.draft_model is None
    d = EngineConfig()
    assert (off.num_speculative_tokens, off.speculative_max_batch, off.prompt_lookup_max, off.prompt_lookup_min) == \
        (d.num_speculative_tokens, d.speculative_max_batch, d.prompt_lookup_max, d.prompt_lookup_min)
    ngram = serve_config.engine_config_from(_args("--speculative", "ngram", "--num-speculative-tokens", "7",
                                         "--speculative-max-batch", "3", "--prompt-lookup-max", "5",
                                         "--prompt-lookup-min", "1"))
    assert (ngram.speculative, ngram.num_speculative_tokens, ngram.speculative_max_batch, ngram.prompt_lookup_max,
            ngram.prompt_lookup_min, ngram.draft_model) == ("ngram", 7, 3, 5, 1, None)
    draft = serve_config.engine_config_from(_args("--speculative", "draft", "--draft-model", "/models/small"))
    assert (draft.speculative, draft.draft_model, draft.num_speculative_tokens) == ("draft", "/models/small", 4)


def test_bad_speculative_flags_are_one_line_in_flag_words(capsys):
    assert _refusal(capsys, "--speculative", "draft") == \
        "--speculative draft needs --draft-model (a model folder), and only it takes one"
    assert _refusal(capsys, "--speculative", "ngram", "--draft-model", "/m") == \
        "--speculative draft needs --draft-model (a model folder), and only it takes one"
    assert _refusal(capsys, "--draft-model", "/m") == \
        "--draft-model is given but speculative decoding is off: add --speculative draft"
    assert _refusal(capsys, "--speculative", "ngram", "--num-speculative-tokens", "0") == \
        "--num-speculative-tokens must be in [1, 16], got 0"
    assert _refusal(capsys, "--speculative", "ngram", "--num-speculative-tokens", "17") == \
        "--num-speculative-tokens must be in [1, 16], got 17"
    assert _refusal(capsys, "--speculative", "ngram", "--speculative-max-batch", "0") == \
        "--speculative-max-batch must be >= 1"
    assert _refusal(capsys, "--speculative", "ngram", "--prompt-lookup-min", "5") == \
        "need 1 <= --prompt-lookup-min <= --prompt-lookup-max, got 5, 4"
    tp = _refusal(capsys, "--speculative", "ngram", "--tensor-parallel-size", "2")
    assert tp.startswith("speculative decoding does not run with tensor parallelism") and "--tensor-parallel-size" in tp
    # Flags that only mean something with --speculative are refused, not ignored.
    assert _refusal(capsys, "--num-speculative-tokens", "8") == \
        "--num-speculative-tokens needs --speculative ngram or draft (speculative decoding is off without it)"
    assert _refusal(capsys, "--prompt-lookup-max", "3", "--prompt-lookup-min", "1") == \
        "--prompt-lookup-max and --prompt-lookup-min need --speculative ngram or draft " \
        "(speculative decoding is off without it)"


def test_an_unknown_method_is_argparse_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        _args("--speculative", "eagle")
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert "argument --speculative: invalid choice: 'eagle'" in err


def test_field_names_in_messages_become_flags():
    words = serve_config.in_flag_words
    assert words("speculative='draft' needs draft_model") == "--speculative draft needs --draft-model"
    assert words("device must be auto, cpu, cuda or cuda:N, got 'tpu'") == \
        "--device must be auto, cpu, cuda or cuda:N, got 'tpu'"
    assert words("speculative decoding is off") == "speculative decoding is off"  # words, not the flag
    assert words("the model is gone") == "the model is gone"  # not at the start: a word


# ---- the request's switch ---------------------------------------------------------------------------
def test_disable_speculation_maps_to_sampling_params():
    assert sampling_from_proto(pb.SamplingParams(disable_speculation=True), max_model_len=64).disable_speculation
    assert not sampling_from_proto(pb.SamplingParams(), max_model_len=64).disable_speculation
    assert pb.SamplingParams.DESCRIPTOR.fields_by_name["disable_speculation"].number >= 50


# ---- metrics and the summary line -------------------------------------------------------------------
def _stats(drafts: int, proposed: int, accepted: int, per_pos: list[int]) -> EngineStats:
    return EngineStats(kv_blocks_total=8, kv_blocks_free=8, requests_running=0, requests_waiting=0,
                       spec_num_drafts=drafts, spec_num_draft_tokens=proposed, spec_num_accepted_tokens=accepted,
                       spec_accepted_per_pos=per_pos)


def test_spec_decode_counters_follow_the_engine_counts():
    now = [_stats(0, 0, 0, [])]
    m = ServiceMetrics("m", lambda: now[0], num_speculative_tokens=3)
    get = m.registry.get_sample_value

    def pos(p: int) -> float | None:
        return get("vllm:spec_decode_num_accepted_tokens_per_pos_total", {"model_name": "m", "position": str(p)})

    assert get("vllm:spec_decode_num_drafts_total", {"model_name": "m"}) == 0
    assert [pos(p) for p in range(4)] == [0, 0, 0, None]  # every position from the first scrape
    now[0] = _stats(5, 14, 9, [5, 3, 1])
    assert get("vllm:spec_decode_num_drafts_total", {"model_name": "m"}) == 5
    assert get("vllm:spec_decode_num_draft_tokens_total", {"model_name": "m"}) == 14
    assert get("vllm:spec_decode_num_accepted_tokens_total", {"model_name": "m"}) == 9
    assert [pos(p) for p in range(3)] == [5, 3, 1]
    off = ServiceMetrics("m", lambda: now[0])
    assert off.registry.get_sample_value("vllm:spec_decode_num_drafts_total", {"model_name": "m"}) is None
    assert off.registry.get_sample_value("vllm:num_preemptions_total", {"model_name": "m"}) == 0


def test_the_summary_line_says_what_was_accepted_when_the_request_speculated():
    log = structlog.get_logger("test")
    with structlog.testing.capture_logs() as lines:
        RequestSummary("Generate", "ipv4:127.0.0.1:1", request_id="a", prompt_tokens=3, generated_tokens=9,
                       num_draft_tokens=8, num_accepted_tokens=6).emit(log)
        RequestSummary("Generate", "ipv4:127.0.0.1:1", request_id="b", prompt_tokens=3).emit(log)
    a, b = lines
    assert (a["num_draft_tokens"], a["num_accepted_tokens"], a["acceptance_rate"]) == (8, 6, 0.75)
    assert not {"num_draft_tokens", "num_accepted_tokens", "acceptance_rate"} & set(b)


# ---- end to end -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # weights x 3: greedy continuations of the random model fall into loops, which prompt lookup proposes
    return make_hf_model_dir(tmp_path_factory.mktemp("llama"), "llama", weight_scale=3.0)


def _serve_flags(model_dir, *extra: str) -> list[str]:
    return ["--model", str(model_dir), "--device", "cpu", "--kv-cache-dtype", "fp32", "--num-kv-blocks", "128",
            "--port", "0", "--metrics-port", "0", "--no-engine-process", "--model-name", MODEL, *extra]


def _server(flags: list[str]) -> BackgroundServer:
    """A server built from `pie serve` flags as the CLI builds it (the engine on a thread, so that
    the test can read its counts)."""
    args = _args(*flags)
    return BackgroundServer(serve_config.server_config_from(args), serve_config.engine_config_from(args))


@pytest.fixture(scope="module")
def spec_server(model_dir):
    with _server(_serve_flags(model_dir, "--speculative", "ngram", "--num-speculative-tokens", str(K))) as s:
        yield s


@pytest.fixture(scope="module")
def plain_server(model_dir):
    with _server(_serve_flags(model_dir)) as s:
        yield s


def _scrape(server) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://{server.pie.config.host}:{server.pie.metrics_port}/metrics",
                                timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _spec(samples, name: str, **labels) -> float:
    return samples[(f"vllm:spec_decode_{name}_total", frozenset({"model_name": MODEL, **labels}.items()))]


PROMPT = "the cat sat on the mat and the dog sat on the log, the cat sat on the mat and the dog sat on the"
GREEDY = dict(max_tokens=48, ignore_eos=True, temperature=0.0)


@pytest.mark.slow
def test_speculating_server_answers_as_a_plain_one_and_counts_its_drafts(spec_server, plain_server):
    with Client(spec_server.address, timeout=60) as spec, Client(plain_server.address, timeout=60) as plain:
        with structlog.testing.capture_logs() as lines:
            greedy = spec.generate(PROMPT, request_id="spec-greedy", **GREEDY)
        assert greedy.token_ids == plain.generate(PROMPT, **GREEDY).token_ids
        assert len(greedy.token_ids) == 48
        # A seeded sample: prompt lookup's verification draws what plain decoding draws.
        seeded = dict(max_tokens=32, ignore_eos=True, temperature=0.8, seed=11)
        assert spec.generate(PROMPT, **seeded).token_ids == plain.generate(PROMPT, **seeded).token_ids
        info = spec.model_info().speculative
        assert plain.model_info().speculative is None

    stats = spec_server.core.stats()
    m = _scrape(spec_server)
    assert _spec(m, "num_drafts") == stats.spec_num_drafts > 0
    assert _spec(m, "num_draft_tokens") == stats.spec_num_draft_tokens >= stats.spec_num_drafts
    assert _spec(m, "num_accepted_tokens") == stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    per_pos = [_spec(m, "num_accepted_tokens_per_pos", position=str(p)) for p in range(K)]
    assert sum(per_pos) == stats.spec_num_accepted_tokens and per_pos == sorted(per_pos, reverse=True)
    assert not any(name.startswith("vllm:spec_decode") for name, _ in _scrape(plain_server))

    assert info is not None and (info.method, info.num_speculative_tokens) == ("ngram", K)
    assert 0 < info.num_drafts <= stats.spec_num_drafts  # the info was read before the stats
    assert info.acceptance_rate == pytest.approx(info.num_accepted_tokens / info.num_draft_tokens)
    assert info.mean_acceptance_length == pytest.approx(1 + info.num_accepted_tokens / info.num_drafts)

    done = next(d for d in lines if d["event"] == "request_done" and d["request_id"] == "spec-greedy")
    assert 0 < done["num_draft_tokens"] and 0 <= done["num_accepted_tokens"] <= done["num_draft_tokens"]
    assert done["acceptance_rate"] == round(done["num_accepted_tokens"] / done["num_draft_tokens"], 3)


@pytest.mark.slow
def test_disable_speculation_makes_no_drafts_and_the_same_tokens(spec_server):
    with Client(spec_server.address, timeout=60) as c:
        before = spec_server.core.stats().spec_num_drafts
        speculated = c.generate(PROMPT, **GREEDY)
        between = spec_server.core.stats().spec_num_drafts
        assert between > before  # this prompt speculates...
        with structlog.testing.capture_logs() as lines:
            plain = c.generate(PROMPT, request_id="spec-off", disable_speculation=True, **GREEDY)
        assert spec_server.core.stats().spec_num_drafts == between  # ...and with the switch it does not
    assert plain.token_ids == speculated.token_ids
    done = next(d for d in lines if d["event"] == "request_done" and d["request_id"] == "spec-off")
    assert done["status"] == "OK" and "num_draft_tokens" not in done
