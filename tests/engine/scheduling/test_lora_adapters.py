"""LoRA adapters through the engine: one batch mixing base requests and four adapters (ranks 8,
16, 64; different target sets) through two GPU slots, greedy ids equal to transformers + peft's
for every request (fp32 pages; int8 and bf16 pages agree as the base model does); a request waits
for a slot instead of failing; prefix-cache blocks never cross adapters; the slots' bookkeeping."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.errors import StartupError
from pie.engine.sampling_params import SamplingParams
from pie.engine.scheduling.adapters import AdapterNotFoundError, Adapters
from pie.engine.scheduling.request import Request
from pie.model.config import ModelConfig
from pie.model.lora import AdapterError
from tests.fidelity import common_prefix, reference_greedy
from tests.helpers import make_hf_model_dir, save_peft_adapter

peft = pytest.importorskip("peft")

ADAPTERS = {
    "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "attn16": dict(r=16, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], use_rslora=True),
    "mlp64": dict(r=64, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all8": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"]),
}
TOKENS = 12


def _hf(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    """(model folder, {adapter: folder}, prompts, each prompt's adapter, peft's greedy ids)."""
    root = tmp_path_factory.mktemp("lora-engine")
    model_dir = make_hf_model_dir(root, "qwen2", seed=11, weight_scale=2.5)  # Qwen2: biased q/k/v
    folders = {}
    for i, (name, conf) in enumerate(ADAPTERS.items()):
        folders[name] = save_peft_adapter(model_dir, root / name, seed=100 + i, scale=3.0, **conf)
    rng = random.Random(7)
    vocab = ModelConfig.from_hf(model_dir / "config.json").vocab_size
    names: list[str | None] = [None, "qv8", "attn16", "mlp64", "all8", None, "qv8", "mlp64"]
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(6, 40))] for _ in names]
    want = []
    for p, name in zip(prompts, names, strict=True):
        hf = _hf(model_dir) if name is None else peft.PeftModel.from_pretrained(_hf(model_dir), folders[name]).eval()
        want.append(reference_greedy(hf, [p], TOKENS)[0])
    return model_dir, folders, prompts, names, want


def _engine(model_dir, folders, kv="fp32", slots=2, **kw) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model_dir), device="cpu", dtype="fp32", kv_cache_dtype=kv,
                                   num_kv_blocks=128, max_num_seqs=8, max_loras=slots, max_lora_rank=64,
                                   loras=tuple((n, str(f)) for n, f in folders.items()), **kw))


def test_mixed_batch_equals_peft(lora_setup):
    model_dir, folders, prompts, names, want = lora_setup
    engine = _engine(model_dir, folders)
    got = engine.generate(prompts, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True), names)
    assert got == want
    # the adapters change the answers: base and adapted runs of one prompt differ
    base = engine.generate(prompts[1:2], SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
    assert base != got[1:2]
    assert engine.adapters is not None and all(a.running == 0 for a in map(engine.adapters.get, folders))


def test_library_gemm_path_equals_peft(lora_setup):
    """lora_shrink="masked" on the Triton path (the interpreter here): the bank's wide B layout and
    the step's one-hot wired through the engine give peft's ids."""
    model_dir, folders, prompts, names, want = lora_setup
    engine = _engine(model_dir, folders, attention_backend="triton", lora_shrink="masked")
    assert engine.adapters is not None and engine.adapters.bank.step.onehot_slots == 2
    got = engine.generate(prompts, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True), names)
    assert got == want


@pytest.mark.parametrize("kv", ["int8", "bf16"])
def test_quantized_pages_agree_as_the_base_does(lora_setup, kv):
    """int8 and bf16 pages round K/V; the adapted rows keep at least the base rows' agreement
    class (TESTING.md: ~0.83 common prefix for int8 on random models): asked here of the whole
    batch, adapters and base alike."""
    model_dir, folders, prompts, names, want = lora_setup
    engine = _engine(model_dir, folders, kv=kv, kv_smoothing="on" if kv == "int8" else "auto")
    got = engine.generate(prompts, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True), names)
    agree = sum(common_prefix(g, w) / TOKENS for g, w in zip(got, want, strict=True)) / len(want)
    assert agree >= 0.6, agree


def test_prefix_blocks_never_cross_adapters(lora_setup):
    """The same prompt under two adapters and the base model: each finds its own cached blocks
    (the chain starts from its adapter's salt), none finds another's."""
    model_dir, folders, prompts, _, _ = lora_setup
    engine = _engine(model_dir, folders, block_size=4)
    p = prompts[2]
    sampling = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.generate([p, p, p], sampling, ["qv8", "all8", None])
    assert engine.adapters is not None

    def cached_blocks(name: str | None) -> set[int]:
        adapter = None if name is None else engine.adapters.get(name)
        probe = Request("probe", p, sampling, max_model_len=engine.max_model_len, adapter=adapter)
        return set(engine.block_manager.find_cached_prefix(probe).block_ids)

    blocks = {name: cached_blocks(name) for name in ("qv8", "all8", None)}
    assert all(len(b) == (len(p) - 1) // 4 for b in blocks.values()), blocks
    assert not blocks["qv8"] & blocks["all8"] and not blocks["qv8"] & blocks[None] and not blocks["all8"] & blocks[None]
    assert not cached_blocks("mlp64")  # an adapter that never ran this prompt finds nothing


def test_unknown_adapter_is_refused(lora_setup):
    model_dir, folders, prompts, _, _ = lora_setup
    engine = _engine(model_dir, folders)
    with pytest.raises(AdapterNotFoundError, match="adapter 'nope': not loaded"):
        engine.add_request("x", prompts[0], SamplingParams(max_tokens=1), adapter="nope")
    plain = EngineCore(EngineConfig(model=str(model_dir), device="cpu", dtype="fp32", num_kv_blocks=32))
    with pytest.raises(AdapterNotFoundError, match="max_loras is 0"):
        plain.add_request("x", prompts[0], SamplingParams(max_tokens=1), adapter="qv8")


def test_config_refusals(lora_setup):
    model_dir, folders, _, _, _ = lora_setup
    with pytest.raises(ValueError, match="max_loras is 0"):
        EngineConfig(loras=(("a", "/x"),))
    with pytest.raises(ValueError, match="speculative decoding"):
        EngineConfig(max_loras=1, speculative="ngram")
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(max_loras=1, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="given twice"):
        EngineConfig(max_loras=1, loras=(("a", "/x"), ("a", "/y")))
    with pytest.raises(ValueError, match="lora_shrink must be one of"):
        EngineConfig(max_loras=1, lora_shrink="mm")
    with pytest.raises(ValueError, match="not batch-invariant"):
        EngineConfig(max_loras=1, lora_shrink="gemm", batch_invariant=True)
    with pytest.raises(ValueError, match="not batch-invariant"):
        EngineConfig(max_loras=1, lora_shrink="masked", batch_invariant=True)
    # the default picks the library GEMM, and the chunked shrink where answers must not depend on the batch
    assert EngineConfig(max_loras=1).lora_shrink_used == "gemm"
    assert EngineConfig(max_loras=1, batch_invariant=True).lora_shrink_used == "chunks"
    with pytest.raises(StartupError, match="--lora mlp64=.*: rank 64 is above the server's --max-lora-rank 16"):
        EngineCore(EngineConfig(model=str(model_dir), device="cpu", dtype="fp32", num_kv_blocks=32, max_loras=1,
                                max_lora_rank=16, loras=(("mlp64", str(folders["mlp64"])),)))


class _Bank:
    """A stand-in bank recording writes (the slots' logic without weights)."""

    num_slots, max_rank = 2, 64

    def __init__(self):
        self.writes: list[tuple[int, str]] = []
        self.cleared: list[int] = []

    def write(self, slot, adapter):
        self.writes.append((slot, adapter.name))

    def clear(self, slot):
        self.cleared.append(slot)


def test_slots_lru_and_unload(lora_setup):
    model_dir, folders, _, _, _ = lora_setup
    cfg = ModelConfig.from_hf(model_dir / "config.json")
    bank = _Bank()
    slots = Adapters(bank, cfg)  # type: ignore[arg-type]
    a, b, c = (slots.load(n, folders[n]) for n in ("qv8", "attn16", "mlp64"))
    assert slots.acquire(a) and slots.acquire(b) and slots.acquire(a)
    assert (a.slot, b.slot) == (0, 1) and a.running == 2
    assert not slots.acquire(c)  # every slot busy: c waits
    slots.release(b)  # b idle: its slot may go
    assert slots.acquire(c) and c.slot == 1 and b.slot == -1
    slots.release(a)
    slots.release(a)
    slots.release(c)
    assert slots.acquire(b) and b.slot == 0  # the least recently used idle slot (a's) goes first
    slots.unload("mlp64")  # idle: its slot is freed at once
    assert c.slot == -1 and 1 in bank.cleared
    with pytest.raises(AdapterNotFoundError):
        slots.get("mlp64")
    slots.unload("attn16")  # running: it keeps its slot until it leaves
    assert b.slot == 0 and 0 not in bank.cleared
    slots.release(b)
    assert b.slot == -1 and 0 in bank.cleared
    with pytest.raises(AdapterError, match="already loaded"):
        slots.load("qv8", folders["qv8"])


@pytest.mark.gpu
def test_cuda_graphs_carry_the_slots(lora_setup):
    """On CUDA the slots are graph inputs: decode graphs and piecewise prompt graphs give the
    eager engine's ids, and both keep peft's (fp32; TF32 attention dots may flip a near tie); so
    does the shrink by one GEMM over every slot (lora_shrink="gemm") and the library-GEMM path
    (lora_shrink="masked")."""
    model_dir, folders, prompts, names, want = lora_setup
    sampling = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    got = {}
    for eager, shrink in ((True, "chunks"), (False, "chunks"), (False, "gemm"), (False, "masked")):
        engine = EngineCore(EngineConfig(model=str(model_dir), device="cuda", dtype="fp32", kv_cache_dtype="fp32",
                                         num_kv_blocks=128, max_num_seqs=8, max_loras=2, max_lora_rank=64,
                                         loras=tuple((n, str(f)) for n, f in folders.items()), enforce_eager=eager,
                                         lora_shrink=shrink))
        got[eager, shrink] = engine.generate(prompts, sampling, names)
        del engine
    assert got[False, "chunks"] == got[True, "chunks"]
    for key in ((False, "chunks"), (False, "gemm"), (False, "masked")):
        agree = sum(common_prefix(g, w) / TOKENS for g, w in zip(got[key], want, strict=True)) / len(want)
        assert agree >= 0.9, (key, agree)


def test_load_and_unload_at_run_time(lora_setup):
    """Through the engine's client, as the servicer calls it: an adapter loaded while the engine
    runs serves at once; unloading it while a request runs on it lets that request finish with
    the same ids, and refuses new requests naming it; errors name the adapter."""
    import asyncio

    from pie.engine.client.thread import ThreadEngineClient

    model_dir, folders, prompts, names, want = lora_setup
    engine = EngineCore(EngineConfig(model=str(model_dir), device="cpu", dtype="fp32", kv_cache_dtype="fp32",
                                     num_kv_blocks=128, max_num_seqs=8, max_loras=1, max_lora_rank=64))
    sampling = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    i = names.index("mlp64")

    async def collect(stream) -> list[int]:
        ids: list[int] = []
        while True:
            for o in await stream.next_batch():
                ids += o.new_token_ids
                if o.all_finished:
                    return ids

    async def scenario():
        handle = ThreadEngineClient.around(engine)
        handle.start(asyncio.get_running_loop())
        try:
            with pytest.raises(AdapterNotFoundError, match="'mlp64': not loaded"):
                handle.submit(prompts[i], sampling, caller_id="early", adapter="mlp64")
            await handle.load_adapter("mlp64", str(folders["mlp64"]))
            assert handle.adapter_names == ["mlp64"]
            with pytest.raises(AdapterError, match="'mlp64': already loaded"):
                await handle.load_adapter("mlp64", str(folders["mlp64"]))
            with pytest.raises(AdapterError, match="'bad': no adapter_config.json"):
                await handle.load_adapter("bad", str(model_dir))
            running = handle.submit(prompts[i], sampling, caller_id="a", adapter="mlp64")
            await handle.unload_adapter("mlp64")  # while it runs (or waits): it finishes on its adapter
            with pytest.raises(AdapterNotFoundError):
                handle.submit(prompts[i], sampling, caller_id="b", adapter="mlp64")
            with pytest.raises(AdapterNotFoundError):
                await handle.unload_adapter("mlp64")
            assert await collect(running) == want[i]
            await handle.wait_idle()
            assert handle.stats().adapters == []
        finally:
            handle.stop()

    asyncio.run(scenario())
    assert engine.adapters is not None and engine.adapters.names() == []
