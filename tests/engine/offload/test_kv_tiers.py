"""The host and disk tiers below the pool (engine/offload/) on the CPU, through the whole engine: a
prompt served cold, from the pool's prefix cache, read back from the host tier and from the disk
tier (also after a restart) gives the same tokens and logprobs to the bit; files of another model or
with a broken record are never served; every tier stays within its bounds; a reset clears all of
them; no block leaks (the invariants after every step); bad settings fail at start."""

from __future__ import annotations

import json
import shutil
import struct
import threading
from pathlib import Path

import pytest
import structlog

from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.errors import StartupError
from pie.engine.messages import SampledToken
from pie.engine.offload.copier import slot_runs
from pie.engine.sampling_params import SamplingParams
from tests.engine.invariants import assert_engine_invariants
from tests.helpers import make_hf_model_dir

BLOCK = 16
HOST_GIB = 1 / 1024  # 1 MiB: hundreds of the tiny model's blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_hf_model_dir(tmp_path_factory.mktemp("tiers"), "llama", weight_scale=3.0)


def make_engine(model_dir: Path, disk: Path | None, kv: str = "int8", **kw) -> EngineCore:
    # Prefill one block a step: a cold prompt's last chunk is then the very step a cached prompt
    # runs (its tokens after the cached blocks), so even the CPU's float rounding agrees.
    cfg = dict(model=str(model_dir), device="cpu", dtype="fp32", kv_cache_dtype=kv, block_size=BLOCK,
               num_kv_blocks=24, max_num_seqs=4, max_num_batched_tokens=BLOCK, kv_host_gib=HOST_GIB,
               kv_disk_dir=None if disk is None else str(disk), kv_disk_gib=None if disk is None else 1 / 1024)
    return EngineCore(EngineConfig(**{**cfg, **kw}))


def serve(engine: EngineCore, prompt: list[int], rid: str, max_tokens: int = 6) -> tuple[list[int], list[SampledToken]]:
    """Runs one greedy request to its end, checking the invariants after every step."""
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3,
                                                   ignore_eos=True))
    return run_to_end(engine)


def run_to_end(engine: EngineCore) -> tuple[list[int], list[SampledToken]]:
    """Steps until every request ended, checking the invariants after each: the tokens and
    logprobs the steps gave."""
    tokens: list[int] = []
    logprobs: list[SampledToken] = []
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.new_token_ids
            logprobs += o.new_logprobs
        assert_engine_invariants(engine)
    return tokens, logprobs


def drain(engine: EngineCore) -> None:
    """Lets copies in flight land (the CPU worker), as steps would."""
    engine.kv_tiers.poll()
    engine.kv_tiers.flush()
    for t in list(engine.kv_tiers._saving.values()):
        t.wait()
    for _, _, f in list(engine.kv_tiers._writes):
        f.exception()
    engine.kv_tiers.poll()
    if engine.kv_tiers.disk is not None:  # and the files it evicted are gone
        engine.kv_tiers.disk._io.submit(lambda: None).result()


def hits(engine: EngineCore) -> dict[str, int]:
    return dict(engine.stats().kv_tier_hit_tokens)


def prompt_of(rng, blocks: int = 3, extra: int = 5) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(blocks * BLOCK + extra)]


@pytest.mark.parametrize("kv", ["int8", "bf16"])
def test_cold_pool_host_and_disk_hits_agree_to_the_bit(model_dir, tmp_path, kv, rng):
    engine = make_engine(model_dir, tmp_path / "disk", kv)
    prompt = prompt_of(rng)
    cold = serve(engine, prompt, "cold")
    pool = serve(engine, prompt, "pool")
    assert engine.block_manager.prefix_cache_hits == 3 * BLOCK and hits(engine) == {"host": 0, "disk": 0}

    drain(engine)
    engine.block_manager.reset_prefix_cache(lower_tiers=False)  # the pool forgets; host and disk keep
    host = serve(engine, prompt, "host")
    assert hits(engine) == {"host": 3 * BLOCK, "disk": 0}

    drain(engine)
    engine.block_manager.reset_prefix_cache(lower_tiers=False)
    engine.kv_tiers.host.clear()  # only the disk holds it now
    disk = serve(engine, prompt, "disk")
    assert hits(engine) == {"host": 3 * BLOCK, "disk": 3 * BLOCK}
    assert cold == pool == host == disk
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    engine.close()


def test_a_restarted_engine_serves_the_disk_hit_of_the_first(model_dir, tmp_path, rng):
    disk = tmp_path / "disk"
    prompts = [prompt_of(rng), prompt_of(rng, blocks=2)]
    first = make_engine(model_dir, disk)
    before = [serve(first, p, f"first-{i}") for i, p in enumerate(prompts)]
    first.close()  # copies and disk writes land
    assert len(list(disk.glob("*.kv"))) == 5

    again = make_engine(model_dir, disk)
    assert again.stats().kv_disk_blocks_used == 5
    after = [serve(again, p, f"again-{i}") for i, p in enumerate(prompts)]
    assert hits(again) == {"host": 0, "disk": 5 * BLOCK}
    assert after == before
    again.close()


def test_foreign_and_corrupt_files_are_never_served(model_dir, tmp_path, rng):
    disk = tmp_path / "disk"
    prompt = prompt_of(rng)
    first = make_engine(model_dir, disk)
    expected = serve(first, prompt, "first")
    first.close()
    files = sorted(disk.glob("*.kv"), key=lambda p: p.stat().st_mtime)
    assert len(files) == 3

    # Another model's file (its header says so) beside ours: skipped at start, with a warning.
    raw = files[2].read_bytes()
    (n,) = struct.unpack("<I", raw[8:12])
    header = json.loads(raw[12:12 + n])
    header.update(fingerprint="0" * 32, model="another", digest="ab" * 16)
    head = json.dumps(header).encode()
    (disk / ("ab" * 16 + ".kv")).write_bytes(raw[:8] + struct.pack("<I", len(head)) + head + raw[12 + n:])
    # Block 1's record damaged: its checksum fails when read.
    damaged = bytearray(files[1].read_bytes())
    damaged[-1] ^= 0xFF
    files[1].write_bytes(bytes(damaged))
    with structlog.testing.capture_logs() as logs:
        again = make_engine(model_dir, disk)
        assert again.stats().kv_disk_blocks_used == 3  # the foreign file is not ours
        served = serve(again, prompt, "again")
    events = [e["event"] for e in logs]
    assert "kv_disk_files_skipped" in events and "kv_disk_read_failed" in events
    assert hits(again) == {"host": 0, "disk": BLOCK}  # block 0 read back; the chain ends at block 1
    assert again.stats().kv_tier_errors["disk"] == 1
    assert served == expected  # blocks 1 and 2 computed again
    assert not files[1].exists()
    again.close()
    assert (disk / ("ab" * 16 + ".kv")).exists()  # left alone: another server may own it


def test_every_tier_is_bounded_lru_and_reset_clears_them(model_dir, tmp_path, rng):
    block_bytes = 2 * 2 * BLOCK * 2 * (16 + 2)  # K and V, 2 layers, 2 kv heads, head_dim 16 int8 + fp16 scale
    disk = tmp_path / "disk"
    # A file is its record and a header of a few hundred bytes: 4.5 records hold 3 files, not 4.
    engine = make_engine(model_dir, disk, kv_host_gib=4 * block_bytes / 2**30, kv_disk_gib=4.5 * block_bytes / 2**30)
    assert engine.kv_tiers.host.num_slots == 4 and engine.kv_tiers.block_bytes == block_bytes
    prompts = [prompt_of(rng, blocks=2, extra=1) for _ in range(3)]  # 2 full blocks each
    for i, p in enumerate(prompts):
        serve(engine, p, f"p{i}")
        drain(engine)
    stats = engine.stats()
    assert stats.kv_host_blocks_used == 4  # 6 blocks written down, the 2 oldest evicted
    assert stats.kv_disk_blocks_used == 3 and stats.kv_disk_bytes_used <= stats.kv_disk_bytes_total
    assert len(list(disk.glob("*.kv"))) == 3
    # The oldest prompt left both tiers (LRU); the newest is still in the host tier.
    engine.block_manager.reset_prefix_cache(lower_tiers=False)
    serve(engine, prompts[0], "oldest")
    assert hits(engine) == {"host": 0, "disk": 0}
    engine.block_manager.reset_prefix_cache(lower_tiers=False)
    serve(engine, prompts[2], "newest")
    assert hits(engine) == {"host": 2 * BLOCK, "disk": 0}
    engine.block_manager.reset_prefix_cache()  # every tier
    drain(engine)
    assert not list(disk.glob("*.kv"))
    stats = engine.stats()
    assert stats.kv_host_blocks_used == 0 and stats.kv_disk_blocks_used == 0 and stats.kv_blocks_cached == 0
    serve(engine, prompts[0], "after-reset")
    assert hits(engine)["host"] == 2 * BLOCK and hits(engine)["disk"] == 0  # nothing more came from below
    engine.close()
    assert len(list(disk.glob("*.kv"))) == engine.stats().kv_disk_blocks_used


def test_slot_runs_cut_slots_into_consecutive_runs():
    assert slot_runs([]) == []
    assert slot_runs([7]) == [(0, 7, 1)]
    assert slot_runs([3, 4, 5, 9, 10, 2, 1]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1), (6, 1, 1)]


def test_a_chain_written_down_takes_ascending_host_slots(model_dir, rng):
    """A chain's rows go down in ascending slot order whatever order the free slots are in (after
    a reset they come back last-freed first), so a read-back moves consecutive rows in one copy;
    and the rows hold the right blocks: the chain read back serves the same tokens, to the bit."""
    block_bytes = 2 * 2 * BLOCK * 2 * (16 + 2)
    engine = make_engine(model_dir, None, kv_host_gib=4 * block_bytes / 2**30)
    for i in range(2):
        serve(engine, prompt_of(rng, blocks=2, extra=1), f"warm{i}")
        drain(engine)
    engine.block_manager.reset_prefix_cache()  # every host row free again, slots 0-3 in LRU order
    prompt = prompt_of(rng, blocks=2, extra=1)
    first = serve(engine, prompt, "chain")
    drain(engine)
    chain = list(engine.kv_tiers.host._entries.values())
    assert [e.slot for e in chain] == [2, 3]  # popped as 3, 2 from the free list; sorted along the chain
    engine.block_manager.reset_prefix_cache(lower_tiers=False)
    assert serve(engine, prompt, "again") == first
    assert hits(engine) == {"host": 2 * BLOCK, "disk": 0}
    engine.close()


def test_bad_settings_fail_at_start(model_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(StartupError, match="--kv-disk-dir .*cannot write there"):
        make_engine(model_dir, blocker / "disk")
    with pytest.raises(StartupError, match="--kv-disk-gib .* free"):
        make_engine(model_dir, tmp_path / "disk", kv_disk_gib=float(shutil.disk_usage(tmp_path).free + 2**40) / 2**30)
    with pytest.raises(StartupError, match="--kv-host-gib .*more host memory than is available"):
        make_engine(model_dir, None, kv_host_gib=2.0**20)
    with pytest.raises(ValueError, match="kv_disk_dir needs kv_host_gib"):
        EngineConfig(model=str(model_dir), kv_disk_dir=str(tmp_path), kv_disk_gib=1.0)
    with pytest.raises(ValueError, match="go together"):
        EngineConfig(model=str(model_dir), kv_host_gib=1.0, kv_disk_dir=str(tmp_path))
    with pytest.raises(ValueError, match="prefix cache"):
        EngineConfig(model=str(model_dir), kv_host_gib=1.0, enable_prefix_caching=False)


def test_other_rows_decode_while_a_read_back_is_in_flight(model_dir, tmp_path, rng):
    """The copy worker is held: the request whose prefix is read back waits, unscheduled, while a
    running request decodes every step; once the blocks land it is admitted as a pool hit."""
    engine = make_engine(model_dir, None)
    prompt = prompt_of(rng)
    expected = serve(engine, prompt, "cold")
    drain(engine)
    engine.block_manager.reset_prefix_cache(lower_tiers=False)
    # (it ends with the read-back's third step: "again" then runs alone, as "cold" did, to the bit)
    engine.add_request("decoding", prompt_of(rng, blocks=1, extra=2),
                       SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    while not engine.scheduler.running or engine.scheduler.running[0].num_output_tokens < 2:
        engine.step()
    gate = threading.Event()
    engine.kv_tiers.copier._worker.submit(gate.wait)  # the worker copies in order: the read-back waits
    engine.add_request("again", prompt, SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True))
    tokens: list[int] = []
    logprobs: list[SampledToken] = []
    for _ in range(3):
        outputs = engine.step()
        assert_engine_invariants(engine)
        assert [o.request_id for o in outputs] == ["decoding"]  # it advanced; "again" waits
        (again,) = engine.scheduler.waiting
        assert again.kv_load is not None and not again.block_ids
    assert len(engine.kv_tiers.held_blocks()) == 3 and not engine.scheduler.running
    gate.set()
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == "again":
                tokens += o.new_token_ids
                logprobs += o.new_logprobs
                if o.num_output_tokens == 1:
                    assert o.num_cached_tokens == 3 * BLOCK
        assert_engine_invariants(engine)
    assert (tokens, logprobs) == expected
    assert hits(engine)["host"] == 3 * BLOCK and engine.stats().kv_readbacks == 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    engine.close()


def test_where_the_device_waits_a_read_back_is_published_at_the_next_schedule(model_dir, rng, monkeypatch):
    """Where a step's device work can wait for a copy in flight (CUDA's events), a read-back's
    blocks are published at the schedule after the one that issued it, landed or not, and its
    request is admitted there, a step sooner than at its landing. Emulated on the CPU: the copies'
    transfers report themselves in flight until the step waits for them; the answer is the cold
    one, to the bit."""
    engine = make_engine(model_dir, None)
    prompt = prompt_of(rng)
    expected = serve(engine, prompt, "cold")
    drain(engine)
    engine.block_manager.reset_prefix_cache(lower_tiers=False)
    copier, waits = engine.kv_tiers.copier, []

    class InFlight:  # a copy the host sees landed only once a step has waited for it
        def __init__(self, transfer):
            self.transfer, self.waited = transfer, False

        def done(self) -> bool:
            return self.waited

        def wait(self) -> None:
            self.transfer.wait()

        def before_next_step(self) -> None:
            waits.append(1)
            self.transfer.before_next_step()
            self.waited = True

    load = copier.load
    monkeypatch.setattr(copier, "load", lambda slots, block_ids, **kw: InFlight(load(slots, block_ids, **kw)))
    monkeypatch.setattr(copier, "device_waits", True)
    engine.add_request("again", prompt, SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True))
    assert engine.step() == [] and engine.scheduler.waiting[0].kv_load is not None  # the read-back issued
    assert not waits
    tokens: list[int] = []
    logprobs: list[SampledToken] = []
    first = True
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.new_token_ids
            logprobs += o.new_logprobs
        if first:  # the next schedule published the blocks (the step waited) and admitted the request;
            # the host rows it read stay pinned until the host sees the copy landed (the next poll)
            assert waits == [1] and [r.request_id for r in engine.scheduler.running] == ["again"]
            assert [e.pins for e in engine.kv_tiers.host._entries.values()] == [1, 1, 1]
            first = False
        assert_engine_invariants(engine)
    assert (tokens, logprobs) == expected
    assert hits(engine)["host"] == 3 * BLOCK and engine.stats().kv_readbacks == 1
    assert all(e.pins == 0 for e in engine.kv_tiers.host._entries.values()) and not engine.kv_tiers._publishing
    engine.close()


def test_a_read_back_not_the_step_waits_for_the_copies_down_of_its_blocks(model_dir, rng):
    """A read-back whose fresh blocks were evicted while their copy down is still in flight hands
    those copies to the read-back's own copy (on CUDA its scatter waits for them on the side
    stream), not to the next step: the steps meanwhile do not wait for the link. Held copies on the
    CPU's worker: the schedule that issues the read-back returns at once, and once the copies land
    the answer is the cold one, to the bit."""
    # 5 blocks: after "other" (3 full blocks and a partial one) ends, a 3-block read-back takes
    # blocks of "other" from the free queue, whose copies down are held
    engine = make_engine(model_dir, None, num_kv_blocks=5)
    prompt = prompt_of(rng)
    expected = serve(engine, prompt, "cold")
    drain(engine)
    engine.block_manager.reset_prefix_cache(lower_tiers=False)
    gate = threading.Event()
    engine.kv_tiers.copier._worker.submit(gate.wait)  # every copy from here on waits behind it
    try:
        engine.add_request("other", prompt_of(rng), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        engine.add_request("again", prompt, SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True))
        done = threading.Event()
        stepper = threading.Thread(target=lambda: (engine.step(), done.set()), daemon=True)
        stepper.start()
        assert done.wait(timeout=30), "the schedule that issued the read-back waited for the held copies down"
        (load,) = engine.kv_tiers._loads
        assert load.overwrites and not engine.kv_tiers._wait_before_step
        assert engine.kv_tiers.counts.reuse_waits >= 1
    finally:
        gate.set()
    assert run_to_end(engine) == expected
    assert hits(engine)["host"] == 3 * BLOCK
    engine.close()


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_a_crowded_pool_preempts_reads_back_and_leaks_nothing(model_dir, rng, speculative):
    """Conversations sharing a system prompt, each turn re-sending its history, with priorities,
    in a pool too small for them (preemption), prefilled in chunks: the invariants hold after every
    step, blocks come back from the host tier, and every block is free at the end."""
    # 10 blocks: the last turn's prompt and reply take 6 of them, so any two requests running at
    # once crowd each other whatever the (random) model answers; with 14, a run whose n-gram
    # proposals were accepted often finished its requests before they met, and saw no preemption.
    engine = make_engine(model_dir, None, num_kv_blocks=10, max_num_batched_tokens=2 * BLOCK, speculative=speculative)
    system = prompt_of(rng, blocks=2, extra=0)
    histories = {f"c{i}": system + prompt_of(rng, blocks=0, extra=9) for i in range(4)}
    for turn in range(3):
        for i, (cid, history) in enumerate(histories.items()):
            engine.add_request(f"{cid}-{turn}", history, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                               priority=i % 2)
        replies: dict[str, list[int]] = {cid: [] for cid in histories}
        while engine.has_unfinished():
            for o in engine.step():
                replies[o.request_id.split("-")[0]] += o.new_token_ids
            assert_engine_invariants(engine)
        for cid in histories:
            assert len(replies[cid]) == 12
            histories[cid] = histories[cid] + replies[cid] + prompt_of(rng, blocks=0, extra=5)
    stats = engine.stats()
    assert stats.kv_tier_hit_tokens["host"] > 0 and stats.kv_readbacks > 0 and stats.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    assert not engine.kv_tiers.held_blocks()
    engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["int8", "bf16"])
def test_on_cuda_pool_host_and_disk_hits_agree_to_the_bit(model_dir, tmp_path, kv, rng):
    """The same on CUDA: pinned host rows, copies on the side stream, CUDA graphs and async
    scheduling on (the defaults). A hit from the pool, the host tier and the disk tier (also after a
    restart) give the same tokens and logprobs to the bit."""
    disk = tmp_path / "disk"
    kw = dict(device="cuda", dtype="bf16", num_kv_blocks=64, max_num_batched_tokens=256)
    engine = make_engine(model_dir, disk, kv, **kw)
    prompt = prompt_of(rng, blocks=6)
    serve(engine, prompt, "cold")
    pool = serve(engine, prompt, "pool")
    drain(engine)
    engine.block_manager.reset_prefix_cache(lower_tiers=False)
    host = serve(engine, prompt, "host")
    assert hits(engine) == {"host": 6 * BLOCK, "disk": 0}
    drain(engine)
    engine.block_manager.reset_prefix_cache(lower_tiers=False)
    engine.kv_tiers.host.clear()
    from_disk = serve(engine, prompt, "disk")
    assert hits(engine) == {"host": 6 * BLOCK, "disk": 6 * BLOCK}
    engine.close()
    again = make_engine(model_dir, disk, kv, **kw)
    restarted = serve(again, prompt, "restarted")
    assert hits(again)["disk"] == 6 * BLOCK
    assert pool == host == from_disk == restarted
    again.close()
