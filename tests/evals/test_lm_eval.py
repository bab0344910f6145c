"""lm-evaluation-harness against the HTTP door, as a user checks a deployment: its
`local-completions` model (loglikelihood by echo + logprobs, and generate_until) on task data that
ships here (tests/evals/stories_mc: YAML over local JSON, no hub), beside lm-eval's own transformers
backend on the same items and the same checkpoint (the bundled model). fp32 pages: every choice's
loglikelihood within 1e-4 and the same generations; int8 and bf16 pages: the accuracy within the
harness's standard error. Its `local-chat-completions` model on a chat checkpoint (SmolLM2-135M-
Instruct, tests/smollm2.py) in its template, with a system prompt and a worked example as earlier
turns (tests/evals/chat_qa), beside the transformers backend with `apply_chat_template`: the same
answers, each cut by pie at its stop strings (the harness leaves chat answers as the server sends
them). benchmarks/lm_eval_pie.py is the larger run, with SmolLM2 and more items."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.lm_eval_pie import evaluate
from pie.engine.config import DEFAULT_MODEL, EngineConfig
from pie.service.server import BackgroundServer, ServerConfig

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow  # starts servers

TASKS = Path(__file__).parent / "stories_mc"
CHAT_TASKS = Path(__file__).parent / "chat_qa"
STORIES = ("pie_stories_mc", "pie_stories_gen")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """lm-eval's transformers backend (fp32, its defaults: a BOS before each context) on both tasks."""
    return _evaluate("hf", dict(pretrained=DEFAULT_MODEL, dtype="float32", device="cpu"))


def _evaluate(model: str, args: dict, folder: Path = TASKS, tasks: tuple[str, ...] = STORIES, **options) -> dict:
    return evaluate(folder, model, args, list(tasks), **options)


def _through_pie(kv: str, tasks: tuple[str, ...] = STORIES) -> dict:
    config = ServerConfig(port=0, http_port=0, grace_s=2)
    with BackgroundServer(config, EngineConfig(device="cpu", kv_cache_dtype=kv, num_kv_blocks=256)) as server:
        # token ids sent as they are (tokenized_requests), with the BOS the transformers backend adds
        return _evaluate("local-completions", dict(
            model=server.pie.admission.model_name, base_url=f"{server.http_url}/v1/completions",
            tokenizer_backend="huggingface", tokenizer=DEFAULT_MODEL, tokenized_requests=True, add_bos_token=True,
            num_concurrent=2, max_retries=1), tasks=tasks)


def _choices(result: dict) -> list[list[float]]:
    return [[r[0][0] for r in s["resps"]] for s in result["samples"]["pie_stories_mc"]]


def test_fp32_pages_score_as_transformers(reference):
    ours = _through_pie("fp32")
    got, want = _choices(ours), _choices(reference)
    assert len(got) == len(want) == 24
    assert max(abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)) < 1e-4
    assert ours["results"]["pie_stories_mc"]["acc,none"] == reference["results"]["pie_stories_mc"]["acc,none"]
    gen = [s["resps"][0][0] for s in ours["samples"]["pie_stories_gen"]]
    assert gen == [s["resps"][0][0] for s in reference["samples"]["pie_stories_gen"]]
    assert any(g.strip() for g in gen)  # the generations are not all empty (the comparison can fail)


@pytest.mark.parametrize("kv", ["int8", "bf16"])
def test_rounded_pages_keep_the_accuracy(reference, kv):
    ours = _through_pie(kv, ("pie_stories_mc",))["results"]["pie_stories_mc"]
    want = reference["results"]["pie_stories_mc"]
    assert abs(ours["acc,none"] - want["acc,none"]) <= want["acc_stderr,none"]


def _chat(model: str, args: dict) -> dict:
    """pie_chat_qa in the checkpoint's chat template: a system prompt, then the task's worked
    example as an earlier user and assistant turn, then the question."""
    return _evaluate(model, args, CHAT_TASKS, ("pie_chat_qa",), apply_chat_template=True, num_fewshot=1,
                     fewshot_as_multiturn=True, system_instruction="Answer in a word.")


def test_chat_completions_answer_as_transformers():
    from tests.smollm2 import build

    folder = str(build())
    config = ServerConfig(port=0, http_port=0, grace_s=2)
    with BackgroundServer(config, EngineConfig(model=folder, device="cpu", kv_cache_dtype="fp32", num_kv_blocks=64)) as server:
        ours = _chat("local-chat-completions", dict(
            model=server.pie.admission.model_name, base_url=f"{server.http_url}/v1/chat/completions",
            num_concurrent=2, max_retries=1))
    ref = _chat("hf", dict(pretrained=folder, dtype="float32", device="cpu"))
    got = [s["resps"][0][0] for s in ours["samples"]["pie_chat_qa"]]
    want = [s["resps"][0][0] for s in ref["samples"]["pie_chat_qa"]]
    assert len(got) == 8
    # The transformers backend cuts its text at the task's stops itself; local-chat-completions
    # sends them as `stop` and keeps what the server returns: pie must cut there, leaving them out.
    assert got == want
    assert not any("." in g or "\n" in g for g in got)
    score = ours["results"]["pie_chat_qa"]["exact_match,none"]
    assert score == ref["results"]["pie_chat_qa"]["exact_match,none"] > 0  # some answers right: the check can fail
    assert "Paris" in got  # in one word, as the system prompt and the worked example asked
