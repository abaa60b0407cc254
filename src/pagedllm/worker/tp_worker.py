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
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from pagedllm.config import ConfigError, EngineConfig
from pagedllm.distributed.comm import TPGroup, host_store, join_store
from pagedllm.distributed.processes import WorkerProcesses, report, watch_parent
from pagedllm.errors import EngineDeadError, describe
from pagedllm.worker.executor import ShardExecutor, StepPlan, engine_plan, rank_device

logger = logging.getLogger(__name__)

# seconds the workers get to leave after the stop broadcast before they are killed
STOP_TIMEOUT = 10.0


def cpu_threads(world: int) -> int:
    """Torch threads per rank on the CPU: this process's threads (OMP_NUM_THREADS, the CPUs
    it may run on) shared out, at least one each."""
    return max(1, torch.get_num_threads() // world)


class TPWorkers:
    """Rank 0's side: spawns ranks 1..N-1, joins their process group, watches them, runs the
    steps with them and stops them."""

    def __init__(self, config: EngineConfig) -> None:
        world = config.tensor_parallel_size
        engine_plan(config, 0, world)  # a size that cannot split fails here
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
        self._threads_before = torch.get_num_threads()
        self.threads = cpu_threads(world) if self.device.type == "cpu" else 0
        self._store: dist.TCPStore | None = host_store(world)
        self._tp: TPGroup | None = None
        self._broken = False  # a step failed: the ranks may be out of step
        self._stopped = False
        self._step = threading.Lock()  # held while the ranks run a step
        self.procs = WorkerProcesses(
            "tensor-parallel worker",
            range(1, world),
            run_rank,
            (world, config, self._store.port, self.threads),
            on_death=self._on_death,
        )

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

    def _on_death(self) -> None:
        """On the monitor thread: a worker died. A rank waiting for it in NCCL would wait
        for ever (NCCL does not see dead peers): abort the groups, so the step raises."""
        if self._tp is not None:
            self._tp.abort()

    def connect(self) -> TPGroup:
        """Rank 0's group, once every worker has joined; ConfigError if one dies first."""
        if self.threads:
            torch.set_num_threads(self.threads)
        made: list[TPGroup | BaseException] = []
        store = self._store
        assert store is not None

        def join() -> None:
            try:
                made.append(TPGroup(store, 0, self.world, self.device))
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
        logger.info("tensor parallelism: %d ranks, workers' pids %s", self.world, self.pids)

    def run(self, forward: Callable[[], torch.Tensor], plan: StepPlan) -> torch.Tensor:
        """One step on every rank: `plan` to the workers, then rank 0's `forward`. Any fault
        in it kills the engine (EngineDeadError): the ranks may be out of step for good."""
        with self._step:
            if self._broken or self._stopped:
                raise EngineDeadError("tensor-parallel step failed: the ranks are out of step")
            try:
                self.tp.broadcast(plan)
                logits = forward()
            except Exception as e:
                raise self._failure(e) from e
            if self.procs.dead_reason is not None:  # a worker died as the step ended
                raise self._failure(RuntimeError("a worker died"))
            return logits

    def _failure(self, error: BaseException) -> EngineDeadError:
        self._broken = True
        why = self.procs.wait_death(2.0) or describe(error)
        return EngineDeadError(f"tensor-parallel step failed: {why}")

    def stop(self, polite: bool = True) -> None:
        """Stop every worker: the stop broadcast (`polite`, when the ranks are in step and
        no step is running), then the death pipe, then kill. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        told = False
        idle = self._step.acquire(timeout=1.0)  # an engine thread still mid-step: no broadcast
        try:
            if (
                polite
                and idle
                and self._tp is not None
                and not self._broken
                and not self.dead_reason
            ):
                try:
                    self._tp.broadcast(None)
                    told = True
                except Exception:
                    logger.exception("stopping the tensor-parallel workers")
        finally:
            if idle:
                self._step.release()
        self.procs.stop(STOP_TIMEOUT, leaving=told)
        if self._tp is not None:
            self._tp.abort()
        self._tp = self._store = None
        if self.threads:
            torch.set_num_threads(self._threads_before)


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
        executor.capture_graphs()  # with rank 0's: the graphs hold the collectives
        while (plan := tp.broadcast()) is not None:
            executor.forward(plan)
    except BaseException as e:
        report(report_to, describe(e))
        logging.getLogger(__name__).exception("tensor-parallel rank %d failed", rank)
        os._exit(1)
