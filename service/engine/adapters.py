"""LoRA adapters on the engine's side: which are served (`AdapterRegistry`) and which sits in
which of the runner's slots (`SlotTable`).

A request names an adapter; validation resolves the name to the adapter's uid, a number
never reused in the process's life, so that an adapter unloaded and loaded again under the
same name is another adapter to the prefix cache (block_manager.py seeds its block hashes
with the uid) and to the slots. The scheduler keeps the adapters of the running sequences
within `--max-loras` (scheduler.py), so a step never needs more slots than there are; the
runner's host side maps each step's adapters to slots (least recently used slot out) and
tells the device side what to write where (runners/model_runner.py, `StepInputs.lora_loads`).

Unloading stops new requests at once; the weights go when the last sequence using them
ends (`release`).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict

from ..models.lora import LoraAdapter


class AdapterRegistry:
    """The served adapters by name and by uid. Thread-safe: the gRPC side resolves, loads
    and unloads; the engine thread acquires, releases and reads weights."""

    def __init__(self, max_loras: int, max_rank: int) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self._lock = threading.Lock()
        self._serving: dict[str, LoraAdapter] = {}  # by name, in load order
        self._by_uid: dict[int, LoraAdapter] = {}  # serving, or unloaded but still in use
        self._in_use: dict[int, int] = {}  # uid -> sequences holding it
        self._unloading: set[int] = set()
        self._uids = itertools.count(1)
        self.version = 0  # bumped by every load and unload

    def add(self, adapter: LoraAdapter) -> LoraAdapter:
        """Serve `adapter` under its name (refused when the name is taken)."""
        with self._lock:
            if adapter.name in self._serving:
                raise ValueError(f"a LoRA adapter named {adapter.name!r} is already loaded")
            adapter.uid = next(self._uids)
            self._serving[adapter.name] = adapter
            self._by_uid[adapter.uid] = adapter
            self.version += 1
            return adapter

    def unload(self, name: str) -> LoraAdapter | None:
        """Stop serving `name` (None: no such adapter); its weights go once unused."""
        with self._lock:
            adapter = self._serving.pop(name, None)
            if adapter is None:
                return None
            self._unloading.add(adapter.uid)
            self._drop_if_unused(adapter.uid)
            self.version += 1
            return adapter

    def lookup(self, name: str) -> LoraAdapter | None:
        with self._lock:
            return self._serving.get(name)

    def serving(self) -> list[LoraAdapter]:
        with self._lock:
            return list(self._serving.values())

    def acquire(self, uid: int) -> bool:
        """A sequence starts using `uid`; False when it was unloaded meanwhile."""
        with self._lock:
            if uid not in self._by_uid or uid in self._unloading:
                return False
            self._in_use[uid] = self._in_use.get(uid, 0) + 1
            return True

    def share(self, uid: int) -> None:
        """Another choice of a running request (a fork) uses the `uid` its first choice
        holds: counted even while unloading, so the weights outlast every choice."""
        with self._lock:
            if not self._in_use.get(uid):
                raise RuntimeError(f"LoRA adapter {uid} shared without a holder")
            self._in_use[uid] += 1

    def release(self, uid: int) -> None:
        with self._lock:
            count = self._in_use.get(uid, 0) - 1
            if count < 0:
                raise RuntimeError(f"LoRA adapter {uid} released more often than acquired")
            self._in_use[uid] = count
            self._drop_if_unused(uid)

    def in_use(self, uid: int) -> int:
        with self._lock:
            return self._in_use.get(uid, 0)

    def weights(self, uid: int) -> LoraAdapter:
        """The adapter `uid` (held by a running sequence, so still here)."""
        with self._lock:
            return self._by_uid[uid]

    def _drop_if_unused(self, uid: int) -> None:
        if uid in self._unloading and not self._in_use.get(uid):
            self._unloading.discard(uid)
            self._in_use.pop(uid, None)
            self._by_uid.pop(uid, None)


class SlotTable:
    """Which adapter (uid) each runner slot holds, as the host side of the steps decided:
    the device side is told every change (`assign`'s loads) and never decides itself, so
    every rank of a sharded model holds the same."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slots: OrderedDict[int, int] = OrderedDict()  # uid -> slot, least recent first

    def assign(self, uids: set[int]) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Slots for this step's adapters -> ({uid: slot}, [(slot, uid) to write first])."""
        if len(uids) > self.num_slots:
            raise RuntimeError(
                f"a step uses {len(uids)} LoRA adapters and there are {self.num_slots} slots "
                "(the scheduler bounds them by --max-loras)"
            )
        for uid in uids & self._slots.keys():
            self._slots.move_to_end(uid)
        loads = []
        for uid in sorted(uids - self._slots.keys()):
            if len(self._slots) < self.num_slots:
                slot = len(self._slots)
            else:  # the least recently used slot that this step doesn't use
                victim = next(u for u in self._slots if u not in uids)
                slot = self._slots.pop(victim)
            self._slots[uid] = slot
            loads.append((slot, uid))
        return {uid: self._slots[uid] for uid in uids}, loads
