"""The state pool's bookkeeping, in pure Python (the scheduler's view, as block_manager.py
is for the KV cache): which slot of the state pool (state_pool.py) each running sequence of
a hybrid model owns.

A sequence takes a slot when it is admitted and gives it back when it finishes or is
preempted (its state is recomputed with its K/V). A fork (another choice of an n > 1
request) takes a slot of its own holding a copy of its parent's state after the prompt:
the copy is handed to the runner, which makes it before the next forward (`take_copies`).
"""

from __future__ import annotations

from .sequence import Sequence

NO_SLOT = -1


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"the state pool needs slots, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._copies: list[tuple[int, int]] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self, seq: Sequence) -> None:
        if seq.state_slot != NO_SLOT:
            raise RuntimeError(f"{seq.request_id} already holds state slot {seq.state_slot}")
        if not self._free:
            raise RuntimeError("no free state slot (the scheduler admits within them)")
        seq.state_slot = self._free.pop()

    def free(self, seq: Sequence) -> None:
        if seq.state_slot != NO_SLOT:
            self._free.append(seq.state_slot)
            seq.state_slot = NO_SLOT

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` starts from a copy of parent's state (made before the next forward)."""
        self.allocate(child)
        self._copies.append((parent.state_slot, child.state_slot))

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) slot copies since the last call, for the runner."""
        copies, self._copies = self._copies, []
        return copies
