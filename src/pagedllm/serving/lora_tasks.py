"""TensorRT-LLM's LoRA request form on `llm_engine` (docs/lora.md): `lora_task_id` (UINT64)
names an adapter; the first request of a task id also carries its `lora_weights` (FP16
[N, W]) and `lora_config` (INT32 [N, 3]), read into our adapter (`lora.trtllm`) and kept
under the id; later requests send the id alone, and an id not kept gets TensorRT-LLM's
error. As its cache, up to `max_cpu_loras` tasks are kept, the least recently used one with
no request in flight evicted for a new one."""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pagedllm.lora.adapter import LoRAError
from pagedllm.lora.request import TASK_INPUTS, LoRARequest
from pagedllm.lora.slots import LoraSlots
from pagedllm.lora.trtllm import adapter_from_rows
from pagedllm.serving.errors import RequestError
from pagedllm.serving.inputs import Getter


def not_cached(task_id: int) -> str:
    """TensorRT-LLM's error (its PeftCacheManager) for an id it does not hold."""
    return f"LoRA task {task_id} not found in cache. Please send LoRA weights with request"


@dataclass(frozen=True)
class Task:
    task_id: int
    request: LoRARequest


class LoraTasks:
    """The task ids `llm_engine` holds. `resolve` is called from one thread (Triton's
    `execute`); `release`, once per resolved task, from any."""

    def __init__(
        self, slots: LoraSlots | None, tensor_parallel: int, new_id: Callable[[], int]
    ) -> None:
        self._slots, self._tp = slots, tensor_parallel
        self._tasks: OrderedDict[int, LoRARequest] = OrderedDict()  # least recently used first
        self._in_flight: Counter[int] = Counter()
        self._new_id = new_id  # LoRANames.new_id: one id space with the named adapters'
        self._lock = threading.Lock()

    def resolve(self, get: Getter) -> Task | None:
        """The request's task (counted in flight until `release`), None without a
        lora_task_id; RequestError when it cannot be served."""
        task_input, weights, config = (get(name) for name in TASK_INPUTS)
        if task_input is None:
            if weights is not None or config is not None:
                raise RequestError("lora_weights and lora_config need a lora_task_id")
            return None
        if self._slots is None:
            raise RequestError("LoRA feature is not enabled.")
        if self._tp > 1:
            raise RequestError(
                "lora_task_id is not supported with tensor_parallel_size > 1: serve the "
                "adapter as a PEFT folder (lora_modules) and name it with lora_name"
            )
        if task_input.size != 1 or not np.issubdtype(task_input.dtype, np.integer):
            raise RequestError(f"lora_task_id must be one integer, got {task_input.tolist()}")
        task_id = int(task_input.reshape(-1)[0])
        if (weights is None) != (config is None):
            raise RequestError("lora_weights and lora_config are sent together")
        with self._lock:
            if task_id in self._tasks:  # kept: weights sent again are not read again
                return self._acquire(task_id)
        if weights is None or config is None:
            raise RequestError(not_cached(task_id))
        request = LoRARequest(f"lora_task_id {task_id}", self._new_id(), "")
        try:
            adapter = adapter_from_rows(
                weights, config, request, self._slots.cfg, self._slots.config.max_lora_rank
            )
        except LoRAError as e:
            raise RequestError(str(e)) from None
        with self._lock:
            self._evict_for_one()
            self._slots.host.pin(adapter)
            self._tasks[task_id] = request
            return self._acquire(task_id)

    def release(self, task: Task) -> None:
        with self._lock:
            self._in_flight[task.task_id] -= 1

    def _acquire(self, task_id: int) -> Task:
        self._tasks.move_to_end(task_id)
        self._in_flight[task_id] += 1
        return Task(task_id, self._tasks[task_id])

    def _evict_for_one(self) -> None:
        assert self._slots is not None
        if len(self._tasks) < self._slots.config.cpu_capacity:
            return
        idle = next((t for t in self._tasks if self._in_flight[t] <= 0), None)
        if idle is None:  # TensorRT-LLM's PeftCacheManager refuses the same way
            raise RequestError(
                f"LoRA cache is full (max_cpu_loras {self._slots.config.cpu_capacity} tasks): "
                "there are no done tasks to evict"
            )
        self._slots.host.unpin(self._tasks.pop(idle).lora_int_id)
        del self._in_flight[idle]
