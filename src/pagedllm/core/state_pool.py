"""The per-request state slots of a hybrid model's linear-attention layers (Qwen3.5's
Gated-DeltaNet): each running request owns one slot of every such layer's state pool (its conv
window and recurrent state, held by the runner: model/gdn_block.py) beside its KV blocks.

A request takes a slot when it is admitted (it waits, like a request short of KV blocks, while
none is free) and gives it back whenever its blocks are freed: finished, aborted, preempted or
rolled back. A preempted request recomputes its prompt and output from the start, so its state
is rebuilt from zeros in whatever slot it gets next; a slot's stale contents are never read
(the runner starts a request whose first computed token is position 0 from zeros)."""

from __future__ import annotations


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        assert num_slots >= 1
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._owner: dict[str, int] = {}  # request -> its slot
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_take(self, request_id: str) -> bool:
        """Whether the request holds a slot or one is free."""
        return request_id in self._owner or bool(self._free)

    def take(self, request_id: str) -> int:
        """The request's slot, given one if it holds none (the caller checked `can_take`)."""
        slot = self._owner.get(request_id)
        if slot is None:
            slot = self._owner[request_id] = self._free.pop()
            self.peak_used = max(self.peak_used, len(self._owner))
        return slot

    def slot(self, request_id: str) -> int:
        return self._owner[request_id]

    def release(self, request_id: str) -> None:
        slot = self._owner.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def holders(self) -> set[str]:
        return set(self._owner)

    def check_integrity(self) -> None:
        held = sorted(self._owner.values())
        assert len(set(held)) == len(held), "a state slot has two owners"
        assert sorted(held + self._free) == list(range(self.num_slots)), "a state slot is lost"
