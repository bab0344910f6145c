"""How closely the engine's greedy output follows transformers', per KV cache dtype: the measure
behind tests/engine/runner/test_kv_fidelity.py and benchmarks/kv_fidelity.py (not a test itself).

Two figures per (model, cache dtype), both against transformers in fp32 on the same weights:
- agreement: the common prefix of the engine's greedy continuation and transformers', over the
  continuation's length, averaged over prompts (compounds: one near-tie flip ends the prefix);
- teacher-forced top-1: at every position of the engine's own continuation, whether its token is
  transformers' argmax given the same context (does not compound);
- first token: whether the first generated token is transformers' (the prefill alone decides it);
- KL to fp32: at every position of the engine's own continuation, KL(transformers' fp32
  distribution || the engine's), in nats, averaged (how far the cache moves the distribution,
  whether or not the argmax flips).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from pie.engine.config import EngineConfig, usable_cores
from pie.engine.core.engine_core import EngineCore
from pie.engine.sampling_params import SamplingParams
from tests.helpers import make_hf_model_dir

BLOCK = next(f.default for f in fields(EngineConfig) if f.name == "block_size")  # tokens a KV block holds


def _threads(device: str) -> dict:
    """An engine here runs in the test's own process with no gRPC loop beside it: on the CPU it
    takes every core (the default leaves one to that loop, halving these runs on two cores)."""
    return {"cpu_threads": usable_cores()} if device == "cpu" else {}


def _sized_pool(lengths: list[int], engine_kwargs: dict) -> dict:
    """`engine_kwargs` with a KV pool holding sequences of these lengths (unless they set one): on
    CUDA an unsized pool takes most of the free memory, and these helpers build one engine while
    another is still alive."""
    block = engine_kwargs.get("block_size", BLOCK)
    return {"num_kv_blocks": sum(n // block + 2 for n in lengths)} | engine_kwargs

# Head dim 64, GQA 2:1: the shape class of Llama-3.2-1B's attention, at toy width.
HEAD_DIM_64 = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, num_hidden_layers=2, vocab_size=512, max_position_embeddings=512)
MASSIVE_K = (16.0, [3, 17])  # K channel pairs (3, 35) and (17, 49) x16, matching Q channels / 16


@dataclass(slots=True)
class Fidelity:
    agreement: float  # mean common-prefix fraction with transformers' greedy continuation
    teacher_forced: float  # fraction of positions where the engine's token is transformers' argmax
    first_token: float  # fraction of prompts whose first generated token is transformers'
    kl: float = 0.0  # mean KL(transformers fp32 || engine) over the positions of the engine's continuation


def _by_length(seqs: list[list[int]]) -> dict[int, list[int]]:
    """length -> the indices of `seqs` of that length: rows of one length batch without padding."""
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(seqs):
        groups.setdefault(len(s), []).append(i)
    return groups


def reference_greedy(hf, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (fp32, EOS ignored). Prompts of one length
    run as one batch (no padding, so no mask to differ from a lone run's; a batch reads the weights
    once per token instead of once per prompt, ~15x less time for 16 prompts on the CPU)."""
    out: list[list[int]] = [[] for _ in prompts]
    for length, rows in _by_length(prompts).items():
        ids = torch.tensor([prompts[i] for i in rows])
        with torch.inference_mode():
            got = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              attention_mask=torch.ones_like(ids), pad_token_id=0)
        for i, row in zip(rows, got[:, length:].tolist()):
            out[i] = row
    return out


def reference_logits(hf, prompts: list[list[int]], continuations: list[list[int]]) -> list[torch.Tensor]:
    """transformers' fp32 logits for each token of each continuation given what precedes it: (n, V)
    per pair; pairs of one total length run as one batch."""
    seqs = [p + c for p, c in zip(prompts, continuations)]
    out: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
    for _, rows in _by_length(seqs).items():
        with torch.inference_mode():
            logits = hf(torch.tensor([seqs[i] for i in rows])).logits.float()
        for row, i in enumerate(rows):
            out[i] = logits[row, len(prompts[i]) - 1:-1]
    return out


def _recording_logits(engine: EngineCore) -> dict[tuple[str, int], torch.Tensor]:
    """From now on, the logits each (request, output index) is sampled from, as the engine ran them."""
    seen: dict[tuple[str, int], torch.Tensor] = {}
    forward = engine.runner.forward_logits

    def recording(out, **kwargs):
        rows, logits = forward(out, **kwargs)
        for row, i in enumerate(rows):
            r = out.scheduled[i].request
            seen[(r.parent_id, r.num_output_tokens)] = logits[row].float().cpu()
        return rows, logits

    engine.runner.forward_logits = recording
    return seen


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure(model_dir: Path, kv_dtypes: tuple[str, ...], *, prompts: int | list[list[int]], tokens: int, seed: int,
            device: str = "cpu", **engine_kwargs) -> dict[str, Fidelity]:
    """Fidelity of the engine with each KV cache dtype on the model in `model_dir` (fp32 weights),
    over `prompts` (token ids), or that many random prompts."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(seed)
    vocab = hf.config.vocab_size
    ps = prompts if isinstance(prompts, list) else [
        [rng.randrange(3, vocab) for _ in range(rng.randrange(8, 64))] for _ in range(prompts)]
    want = reference_greedy(hf, ps, tokens)
    out = {}
    for kv in kv_dtypes:
        engine = EngineCore(EngineConfig(model=str(model_dir), device=device, dtype="fp32", kv_cache_dtype=kv,
                                        num_kv_blocks=256, max_num_seqs=32, **{**_threads(device), **engine_kwargs}))
        logits = _recording_logits(engine)
        ids = [f"fid-{i}" for i in range(len(ps))]
        for rid, p in zip(ids, ps):
            engine.add_request(rid, p, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        got_by_id: dict[str, list[int]] = {rid: [] for rid in ids}
        while engine.has_unfinished():
            for o in engine.step():
                got_by_id[o.request_id].extend(o.new_token_ids)
        got = [got_by_id[rid] for rid in ids]
        agree = sum(common_prefix(g, w) / tokens for g, w in zip(got, want)) / len(ps)
        forced, kls = [], []
        for rid, g, ref in zip(ids, got, reference_logits(hf, ps, got)):  # ref: (n, V)
            forced += (ref.argmax(-1) == torch.tensor(g)).tolist()
            mine = torch.stack([logits[(rid, j)] for j in range(len(g))])
            kls.append(torch.nn.functional.kl_div(mine.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                                  reduction="none").sum(-1).mean().item())
        first = sum(g[0] == w[0] for g, w in zip(got, want)) / len(ps)
        out[kv] = Fidelity(agree, sum(forced) / len(forced), first, sum(kls) / len(kls))
    return out


def family_fidelity(tmp: Path, archs, kv_dtypes, *, prompts: int, tokens: int, seed: int, weight_scale: float,
                    massive_k: tuple[float, list[int]] | None, **engine_kwargs) -> dict[str, dict[str, Fidelity]]:
    """`measure` on one fresh head-dim-64 model per family; arch -> kv dtype -> Fidelity."""
    rng = random.Random(seed)
    res = {}
    for arch in archs:
        model_dir = make_hf_model_dir(tmp, arch, seed=rng.randrange(2**31), weight_scale=weight_scale,
                                      massive_k=massive_k, **HEAD_DIM_64)
        res[arch] = measure(model_dir, kv_dtypes, prompts=prompts, tokens=tokens, seed=rng.randrange(2**31),
                            **engine_kwargs)
    return res


def mean(res: dict[str, dict[str, Fidelity]], kv: str, field: str) -> float:
    return sum(getattr(r[kv], field) for r in res.values()) / len(res)


# ---- A real checkpoint (tests/smollm2.py): perplexity over real text, beside the figures above.

# Python's own documentation, in every Python: ordinary technical English with code.
DOCS_TOPICS = ("execmodel", "objects", "exceptions", "typesmethods")


def docs_text() -> str:
    from pydoc_data.topics import topics

    return "\n".join(topics[name] for name in DOCS_TOPICS)


@dataclass(slots=True)
class TextFidelity:
    ppl: float  # perplexity of the text, the engine's prompt logprobs
    ppl_ref: float  # transformers' (fp32) on the same chunks
    teacher_forced: float  # positions of the text where the engine's top-1 is transformers' argmax
    tokens: int  # positions scored


def _chunks(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i:i + size] for i in range(0, len(ids), size) if len(ids[i:i + size]) > 1]


def text_fidelity(model_dir: Path, kv_dtypes: tuple[str, ...], text: str, *, chunk: int = 512,
                  device: str = "cpu", **engine_kwargs) -> dict[str, TextFidelity]:
    """Perplexity and teacher-forced top-1 over `text` in `chunk`-token prompts, each scored on its
    own (the first token of a chunk is not), per KV cache dtype, from the engine's prompt logprobs,
    against transformers in fp32."""
    import math

    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    chunks = _chunks(tok(text, add_special_tokens=False)["input_ids"], chunk)
    nll_ref, best = 0.0, []
    with torch.inference_mode():
        for c in chunks:
            logp = hf(torch.tensor([c])).logits[0, :-1].float().log_softmax(-1)
            nll_ref -= logp.gather(1, torch.tensor(c[1:])[:, None]).sum().item()
            best.append(logp.argmax(-1).tolist())
    n = sum(len(c) - 1 for c in chunks)
    out = {}
    pool = _sized_pool([len(c) for c in chunks], engine_kwargs)
    for kv in kv_dtypes:
        engine = EngineCore(EngineConfig(model=str(model_dir), device=device, dtype="fp32", kv_cache_dtype=kv,
                                        max_num_seqs=len(chunks), max_num_batched_tokens=chunk * len(chunks),
                                        **{**_threads(device), **pool}))
        entries: dict[str, list] = {}
        for i, c in enumerate(chunks):
            engine.add_request(f"ppl-{i}", c, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
        while engine.has_unfinished():
            for o in engine.step():
                entries.setdefault(o.request_id, []).extend(o.prompt_logprobs or [])
        nll, hits = 0.0, 0
        for i, c in enumerate(chunks):
            scored = entries[f"ppl-{i}"][-(len(c) - 1):]  # position 0 has no logprob
            assert [e.token_id for e in scored] == c[1:]
            nll -= sum(e.logprob for e in scored)
            hits += sum(e.top[0][0] == b for e, b in zip(scored, best[i]))
        out[kv] = TextFidelity(math.exp(nll / n), math.exp(nll_ref / n), hits / n, n)
    return out


def text_prompts(model_dir: Path, text: str, n: int, length: int = 48) -> list[list[int]]:
    """n prompts of `length` tokens taken at even steps through `text`."""
    import transformers

    ids = transformers.AutoTokenizer.from_pretrained(model_dir)(text, add_special_tokens=False)["input_ids"]
    step = (len(ids) - length) // max(1, n - 1)
    return [ids[i * step:i * step + length] for i in range(n)]


@dataclass(slots=True)
class Consistency:
    """How far a prompt's results move when the engine computes it otherwise than in one step."""

    mean_diff: float  # mean |logprob difference| over the compared positions
    max_diff: float
    top1_differs: float  # share of the compared positions whose top-1 token differs
    greedy_equal: int  # greedy continuations identical to the one-step run's
    greedy_total: int


def _prompt_runs(engine: EngineCore, prompts: list[list[int]], tokens: int, *, prompt_logprobs: bool
                 ) -> tuple[list[list], list[list[int]]]:
    """Each prompt alone, greedy: the logprobs (top 1) of its prompt positions (with
    `prompt_logprobs`, which computes every position: no prefix cache) or of its first generated
    token (what the prefill decides), and its `tokens` generated ids."""
    entries, outs = [], []
    for i, p in enumerate(prompts):
        sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=1,
                            prompt_logprobs=1 if prompt_logprobs else None)
        engine.add_request(f"c-{i}-{engine.stats().prefix_cache_queries}", p, sp)
        got, ids = [], []
        while engine.has_unfinished():
            for o in engine.step():
                got.extend((o.prompt_logprobs or []) if prompt_logprobs else o.new_logprobs)
                ids.extend(o.new_token_ids)
        entries.append(got[-(len(p) - 1):] if prompt_logprobs else got[:1])
        outs.append(ids)
    return entries, outs


def consistency(model_dir: Path, kv: str, prompts: list[list[int]], *, step: int, tokens: int = 32,
                device: str = "cpu", **engine_kwargs) -> dict[str, Consistency]:
    """Against each prompt computed in one step, alone, greedy: the prompt computed in `step`-token
    steps ("chunked": its prompt positions' logprobs compared), and read back from the prefix cache
    by the same engine's second run ("cached": the first generated token's logprob compared, the
    cache holding every full block of the prompt); both also by their greedy continuations."""
    longest = max(map(len, prompts))

    # Every prompt's blocks stay cached for the second run, beside 4 running sequences.
    pool = _sized_pool([longest + tokens] * (len(prompts) + 4), engine_kwargs)

    def engine(budget: int) -> EngineCore:
        return EngineCore(EngineConfig(model=str(model_dir), device=device, dtype="fp32", kv_cache_dtype=kv,
                                       max_num_seqs=4, max_num_batched_tokens=budget, **{**_threads(device), **pool}))

    whole = engine(longest + tokens)
    # cold first, on an empty cache: a prompt-logprobs run reads no cache but fills it
    cold = _prompt_runs(whole, prompts, tokens, prompt_logprobs=False)
    assert whole.stats().prefix_cache_hits == 0, "the cold run read the prefix cache"
    pairs = {"cached": (cold, _prompt_runs(whole, prompts, tokens, prompt_logprobs=False))}
    assert whole.stats().prefix_cache_hits > 0, "the second run did not read the prefix cache"
    pairs["chunked"] = (_prompt_runs(whole, prompts, tokens, prompt_logprobs=True),
                        _prompt_runs(engine(step), prompts, tokens, prompt_logprobs=True))
    out = {}
    for name, ((base, base_out), (entries, outs)) in pairs.items():
        diffs, flips = [], 0
        for a, b in zip(base, entries):
            for x, y in zip(a, b):
                diffs.append(abs(x.logprob - y.logprob))
                flips += x.top[0][0] != y.top[0][0]
        out[name] = Consistency(sum(diffs) / len(diffs), max(diffs), flips / len(diffs),
                                sum(o == b for o, b in zip(outs, base_out)), len(outs))
    return out
