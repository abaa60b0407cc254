"""The collectives of tensor parallelism, on torch.distributed process groups: gloo on the
CPU, NCCL on GPUs, plus a gloo group for the step broadcast (plain Python objects).

The groups are built directly from a `TCPStore` that rank 0 hosts, not through
`init_process_group`: no global state, so one process can hold several engines (tests do)
and an engine's close leaves nothing behind.
"""

from __future__ import annotations

import datetime
import logging
import pickle
import time
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# collectives wait this long for a peer: the workers wait for the next step as long as the
# engine idles (a dead peer is seen at once: its sockets close; a dead parent by the workers'
# death pipe)
IDLE_TIMEOUT = datetime.timedelta(days=365)
STORE_TIMEOUT = datetime.timedelta(seconds=300)
# a step's plan fits this buffer (a decode step of 256 requests with 2k-token contexts is
# about 40 KiB pickled): one broadcast per step
BROADCAST_BYTES = 1 << 16


def host_store(world: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (`.port`)."""
    return dist.TCPStore(
        "127.0.0.1", 0, world, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False
    )


def join_store(port: int, world: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=STORE_TIMEOUT)


def _gloo(store: dist.Store, rank: int, world: int) -> Any:
    gloo: Any = dist.ProcessGroupGloo
    opts = gloo._Options()
    opts._timeout = IDLE_TIMEOUT
    opts._devices = [gloo.create_device(hostname="127.0.0.1")]  # loopback: one host
    return gloo(store, rank, world, opts)


class TPGroup:
    """Rank `rank` of `world`: the collectives the sharded model and the step loop use."""

    def __init__(self, store: dist.Store, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world = rank, world
        # seconds spent waiting for collectives, and their count (benchmarks read them; on a
        # GPU an NCCL wait returns once the op is queued on the stream)
        self.wait_seconds = 0.0
        self.waits = 0
        self._buf = torch.zeros(BROADCAST_BYTES, dtype=torch.uint8)  # `broadcast`'s
        self.control: Any = _gloo(dist.PrefixStore("control", store), rank, world)
        self.tensors: Any = self.control
        if device.type == "cuda":
            nccl: Any = dist.ProcessGroupNCCL
            opts = nccl.Options()
            opts._timeout = IDLE_TIMEOUT
            self.tensors = nccl(dist.PrefixStore("nccl", store), rank, world, opts)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        self._wait(self.tensors.allreduce([x]))
        return x

    def gather_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's (S, V / world) logits, joined along the vocabulary on rank 0 (None
        elsewhere)."""
        x = x.contiguous()
        out = [[torch.empty_like(x) for _ in range(self.world)]] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self._wait(self.tensors.gather(out, [x], opts))
        return torch.cat(out[0], dim=1) if self.rank == 0 else None

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank: pickled into a fixed buffer of `BROADCAST_BYTES`
        (its length first), one broadcast; a larger object sends the rest in a second."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        head = BROADCAST_BYTES - 8
        if self.rank == 0:
            data = pickle.dumps(obj)
            self._buf[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
            first = min(len(data), head)
            self._buf[8 : 8 + first] = torch.frombuffer(bytearray(data[:first]), dtype=torch.uint8)
        self._wait(self.control.broadcast([self._buf], opts))
        size = int(self._buf[:8].view(torch.int64).item())
        if size > head:
            rest = torch.empty(size - head, dtype=torch.uint8)
            if self.rank == 0:
                rest.copy_(torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8))
            self._wait(self.control.broadcast([rest], opts))
        if self.rank == 0:
            return obj
        data = self._buf[8 : 8 + min(size, head)].numpy().tobytes()
        if size > head:
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def _wait(self, work: Any) -> None:
        start = time.perf_counter()
        work.wait()
        self.wait_seconds += time.perf_counter() - start
        self.waits += 1

    def abort(self) -> None:
        """Make pending and later collectives fail instead of waiting for a dead peer (NCCL
        would wait for ever; gloo fails by itself once a peer's sockets close)."""
        if self.tensors is not self.control and hasattr(self.tensors, "abort"):
            try:
                self.tensors.abort()
            except Exception:  # already aborted, or torch's NCCL build lacks it
                logger.exception("aborting the NCCL group")

    def barrier(self) -> None:
        self.control.barrier().wait()
