"""The engine's LoRA adapters (host-side bookkeeping, like the block manager's): which are known, which hold a GPU slot, who is using them.

An adapter is loaded by name from a PEFT folder (model/lora.py reads and checks it) and kept in host
memory; it takes one of the `max_loras` slots of the model's bank (model/lora.LoraBank) only while
requests run on it, plus as long as no other adapter needs the slot (LRU among idle residents).
A request names its adapter at admission (`get`, an unknown name is refused there); the scheduler
calls `acquire` before it admits the request (False: every slot is held by running requests of
other adapters; the request keeps waiting, it does not fail) and `release` whenever it leaves the
running set (finished, aborted, failed, preempted).

Unloading an adapter with requests running lets them finish: the name is gone at once (new
requests are refused), the slot is freed when the last one leaves.

Prefix caching: two adapters never share KV blocks. Each load gets a `salt`, the parent of its
requests' first block in the hash chain (engine/scheduling/block_manager.py), so blocks computed
under one adapter (or under an earlier load of the same name, which may hold other weights) are
never found by another's prompt.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from pie.model.config import ModelConfig
from pie.model.lora import AdapterError, LoraAdapter, LoraBank, load_peft_adapter

log = structlog.get_logger(__name__)

_loads = itertools.count(1)


class AdapterNotFoundError(AdapterError):
    """A request or command names an adapter the engine does not know."""


@dataclass(slots=True, eq=False)
class Adapter:
    """A loaded adapter: its weights in host memory and where it stands."""

    name: str
    path: str
    weights: LoraAdapter = field(repr=False)
    salt: int  # the parent hash of its requests' first KV block (module docstring)
    slot: int = -1  # the bank slot holding it; -1: host memory only
    running: int = 0  # requests holding its slot
    unloaded: bool = False  # its name is gone; the slot goes when `running` reaches 0

    @property
    def rank(self) -> int:
        return self.weights.rank


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """One adapter as `ListAdapters` and the metrics see it."""

    name: str
    path: str
    rank: int
    resident: bool  # holds a GPU slot now
    running: int  # requests running on it
    waiting: int = 0  # requests waiting for it (filled by the scheduler's view)


class Adapters:
    """Loaded adapters and the bank's slots (module docstring)."""

    def __init__(self, bank: LoraBank, model_config: ModelConfig) -> None:
        self.bank = bank
        self.model_config = model_config
        self.max_rank = bank.max_rank
        self._by_name: dict[str, Adapter] = {}
        self._slots: list[Adapter | None] = [None] * bank.num_slots
        # idle residents (running == 0), least recently used first: the slots a load may take
        self._idle: OrderedDict[int, Adapter] = OrderedDict()

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def load(self, name: str, path: str | Path) -> Adapter:
        """Read the PEFT folder and register it under `name` (not yet in a slot). AdapterError
        when it cannot be served or the name is taken."""
        if not name or name != name.strip():
            raise AdapterError(name, "a name must be non-empty without surrounding spaces")
        if name in self._by_name:
            raise AdapterError(name, "already loaded (unload it first)")
        weights = load_peft_adapter(name, path, self.model_config, max_rank=self.max_rank)
        adapter = Adapter(name=name, path=str(path), weights=weights, salt=hash(("lora", name, next(_loads))))
        self._by_name[name] = adapter
        log.info("adapter_loaded", adapter=name, path=str(path), rank=weights.rank, targets=sorted(weights.targets))
        return adapter

    def unload(self, name: str) -> None:
        """Forget `name`: new requests are refused; running ones finish on its slot."""
        adapter = self.get(name)
        del self._by_name[name]
        adapter.unloaded = True
        if adapter.running == 0 and adapter.slot >= 0:
            self._free_slot(adapter)
        log.info("adapter_unloaded", adapter=name, still_running=adapter.running)

    def get(self, name: str) -> Adapter:
        adapter = self._by_name.get(name)
        if adapter is None:
            raise AdapterNotFoundError(name, "not loaded")
        return adapter

    def names(self) -> list[str]:
        return list(self._by_name)

    def acquire(self, adapter: Adapter) -> bool:
        """Hold a slot for one more request on `adapter` (written into a free or the least recently
        used idle slot if it has none). False, changing nothing, when every slot is busy."""
        if adapter.slot < 0:
            slot = self._take_slot()
            if slot is None:
                return False
            self.bank.write(slot, adapter.weights)
            adapter.slot = slot
            self._slots[slot] = adapter
        elif adapter.running == 0:
            del self._idle[adapter.slot]
        adapter.running += 1
        return True

    def release(self, adapter: Adapter) -> None:
        """One request on `adapter` left the running set."""
        assert adapter.running > 0 and adapter.slot >= 0, f"release without acquire: {adapter}"
        adapter.running -= 1
        if adapter.running:
            return
        if adapter.unloaded:
            self._free_slot(adapter)
        else:
            self._idle[adapter.slot] = adapter  # most recently used last

    def _take_slot(self) -> int | None:
        for slot, held in enumerate(self._slots):
            if held is None:
                return slot
        if not self._idle:
            return None
        slot, evicted = self._idle.popitem(last=False)
        evicted.slot = -1
        self._slots[slot] = None
        log.debug("adapter_evicted", adapter=evicted.name, slot=slot)
        return slot

    def _free_slot(self, adapter: Adapter) -> None:
        self._idle.pop(adapter.slot, None)
        self.bank.clear(adapter.slot)
        self._slots[adapter.slot] = None
        adapter.slot = -1

    def resolve(self, name: str | None) -> Adapter | None:
        """The adapter a request names (None: the base model); AdapterNotFoundError."""
        return None if name is None else self.get(name)

    def info(self, waiting: dict[str, int] | None = None) -> list[AdapterInfo]:
        waiting = waiting or {}
        return [AdapterInfo(a.name, a.path, a.rank, a.slot >= 0, a.running, waiting.get(a.name, 0))
                for a in self._by_name.values()]
