"""Tensor parallelism's processes: rank 0 (`TPWorkers`, in the engine's process, beside the
scheduler) and ranks 1..N-1 (`run_rank`, each a spawned daemon worker process).

Each step rank 0 broadcasts the `StepPlan` (one torch.distributed broadcast on the gloo
control group); every rank runs its shard of the forward pass, and rank 0 alone gets the
gathered logits and samples. A `None` plan stops the workers. A worker that dies — or any
fault inside a tensor-parallel step, which leaves the ranks out of step — kills the engine
(`EngineDeadError`): its requests fail with the reason, and the server turns unready.
"""

from __future__ import annotations

import logging
import os
import threading
from multiprocessing.connection import Connection

import torch

from pagedllm.config import ConfigError, EngineConfig
from pagedllm.distributed.comm import TPGroup, host_store, join_store
from pagedllm.distributed.processes import WorkerProcesses, report, watch_parent
from pagedllm.distributed.shard import ShardPlan
from pagedllm.errors import EngineDeadError, describe
from pagedllm.worker.executor import ShardExecutor, rank_device

logger = logging.getLogger(__name__)

# seconds the workers get to leave after the stop broadcast before they are killed
STOP_TIMEOUT = 10.0


def cpu_threads(world: int) -> int:
    """Torch threads per rank on the CPU: the cores shared out, at least one each."""
    return max(1, (os.cpu_count() or 1) // world)


class TPWorkers:
    """Rank 0's side: spawns ranks 1..N-1, joins their process group, watches them."""

    def __init__(self, config: EngineConfig) -> None:
        world = config.tensor_parallel_size
        ShardPlan.create(config.model, 0, world)  # a size that cannot split fails here
        self.world = world
        self.device = rank_device(config.device, 0)
        if (
            self.device.type == "cuda"
            and (self.device.index or 0) + world > torch.cuda.device_count()
        ):
            raise ConfigError(
                f"tensor_parallel_size {world} from {self.device} needs GPUs up to "
                f"cuda:{(self.device.index or 0) + world - 1}; torch sees "
                f"{torch.cuda.device_count()}"
            )
        self.threads = cpu_threads(world) if self.device.type == "cpu" else 0
        self._store = host_store(world)
        self.procs = WorkerProcesses(
            "tensor-parallel worker",
            range(1, world),
            run_rank,
            (world, config, self._store.port, self.threads),
        )
        self._tp: TPGroup | None = None
        self._broken = False

    @property
    def tp(self) -> TPGroup:
        assert self._tp is not None, "connect() first"
        return self._tp

    @property
    def pids(self) -> list[int]:
        return self.procs.pids

    @property
    def dead_reason(self) -> str | None:
        return self.procs.dead_reason

    def connect(self) -> TPGroup:
        """Rank 0's group, once every worker has joined; ConfigError if one dies first."""
        if self.threads:
            torch.set_num_threads(self.threads)
        made: list[TPGroup | BaseException] = []

        def join() -> None:
            try:
                made.append(TPGroup(self._store, 0, self.world, self.device))
            except BaseException as e:
                made.append(e)

        joiner = threading.Thread(target=join, name="pagedllm-tp-connect", daemon=True)
        joiner.start()
        while joiner.is_alive():
            joiner.join(0.1)
            if (dead := self.procs.dead_reason) is not None:
                raise ConfigError(f"tensor parallelism could not start: {dead}")
        if isinstance(made[0], BaseException):
            raise ConfigError(f"tensor parallelism could not start: {describe(made[0])}")
        self._tp = made[0]
        return self._tp

    def wait_ready(self) -> None:
        """Wait for every worker to hold its shard (rank 0 holds its own)."""
        try:
            self.tp.barrier()
        except Exception as e:
            self._broken = True
            why = self.procs.wait_death(5) or describe(e)
            raise ConfigError(f"a tensor-parallel worker failed to load: {why}") from e
        logger.info("tensor parallelism: %d ranks, workers' pids %s", self.world, self.procs.pids)

    def failure(self, error: BaseException) -> EngineDeadError:
        """What a fault inside a tensor-parallel step means: the engine is dead."""
        self._broken = True
        why = self.procs.wait_death(1.0) or describe(error)
        return EngineDeadError(f"tensor-parallel step failed: {why}")

    def stop(self) -> None:
        """Stop every worker: the stop broadcast (when the ranks are in step), then the death
        pipe, then kill."""
        told = False
        if self._tp is not None and not self._broken and self.procs.dead_reason is None:
            try:
                self._tp.broadcast(None)
                told = True
            except Exception:
                logger.exception("stopping the tensor-parallel workers")
        self.procs.stop(STOP_TIMEOUT, leaving=told)


def run_rank(
    rank: int,
    world: int,
    config: EngineConfig,
    port: int,
    threads: int,
    death: Connection,
    report_to: Connection,
) -> None:
    """A worker process's main: join the group, load this rank's shard, run steps until the
    stop broadcast."""
    watch_parent(death)
    logging.basicConfig(format=f"%(asctime)s rank {rank} %(name)s %(levelname)s: %(message)s")
    try:
        if threads:
            torch.set_num_threads(threads)
        device = rank_device(config.device, rank)
        tp = TPGroup(join_store(port, world), rank, world, device)
        executor = ShardExecutor(config, rank, world, tp)
        tp.barrier()
        while (plan := tp.broadcast()) is not None:
            executor.forward(plan)
    except BaseException as e:
        report(report_to, describe(e))
        logging.getLogger(__name__).exception("tensor-parallel rank %d failed", rank)
        os._exit(1)
