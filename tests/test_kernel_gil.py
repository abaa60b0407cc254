"""The CPU kernels release the GIL while they compute: in the served engine the sender thread
builds and sends the last step's responses (Python) while the engine thread's step runs in
C++; a kernel that kept the GIL would hold it back for the whole step.

A ticker thread wakes every 0.1 ms and counts the wake-ups it gets while a kernel call is in
progress; its rate with the main thread asleep is the yardstick. The switch interval is set to
a second, so a thread holding the GIL is never made to give it up: while a kernel that kept
it runs, the ticker gets no turn at all. The kernels run on one thread, leaving the ticker a
core."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import make_checkpoint, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.layers import quant
from pagedllm.layers.attention import cpu_kernels

pytestmark = pytest.mark.skipif(
    not cpu_kernels.kernel_available(), reason="the CPU extension does not build here"
)


class Ticker:
    def __init__(self) -> None:
        self.inside = False  # a kernel call is in progress
        self.ticks = 0
        self.ticks_inside = 0
        self.time_inside = 0.0
        self.calls = 0
        self._stop = threading.Event()
        self.running = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.running.set()
        while not self._stop.is_set():
            self.ticks += 1
            if self.inside:
                self.ticks_inside += 1
            time.sleep(1e-4)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            self.calls += 1
            self.inside = True
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.time_inside += time.perf_counter() - start
                self.inside = False

        return call

    def rate(self) -> float:
        """Wake-ups per second with this thread asleep."""
        start, t0 = self.ticks, time.perf_counter()
        time.sleep(0.1)
        return (self.ticks - start) / (time.perf_counter() - t0)


@contextmanager
def ticking() -> Iterator[Ticker]:
    """A running ticker; on leaving, asserts that it got at least a quarter of its turns inside
    the kernel calls it wrapped (with the GIL released it gets ~0.9 of them here; held, 0-0.05:
    only inside the kernels that release it themselves)."""
    ticker = Ticker()
    interval, threads = sys.getswitchinterval(), torch.get_num_threads()
    sys.setswitchinterval(1.0)
    torch.set_num_threads(1)
    ticker._thread.start()
    ticker.running.wait()
    try:
        rate = ticker.rate()
        yield ticker
    finally:
        ticker._stop.set()
        ticker._thread.join()
        sys.setswitchinterval(interval)
        torch.set_num_threads(threads)
    expected = rate * ticker.time_inside
    assert ticker.calls and ticker.ticks_inside >= expected / 4, (ticker.ticks_inside, expected)


def test_a_decode_step_releases_the_gil(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant, "KERNEL_MAX_ROWS", dict.fromkeys(quant.KERNEL_MAX_ROWS))
    # wide enough that the linear layers (which hold most of a step) take milliseconds
    path = make_checkpoint(tmp_path / "wide", "llama", hidden_size=1024, intermediate_size=4096)
    llm = LLM(str(path), max_num_seqs=4, max_model_len=256)
    assert llm.engine.runner.model._kernel_weights, "the one-call path is not set up"
    module = cpu_kernels.kernel_module()
    prompts = random_prompts(4, (8, 16), 384, seed=0)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with ticking() as ticker:
        monkeypatch.setattr(module, "decode_layers", ticker.wrap(module.decode_layers))
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert ticker.calls >= 20


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4", "int8-packed", "int4-packed"])
def test_linear_kernels_release_the_gil(fmt: str) -> None:
    torch.manual_seed(0)
    # 32 MiB of weight in every format (calls of ~1-4 ms): on a busy machine a call much
    # shorter than the ticker's wake-up latency would count too few ticks whatever the GIL does
    bits = {"fp32": 32, "bf16": 16}.get(fmt, 8 if fmt.startswith("int8") else 4)
    w = torch.randn(4096 * 32 // bits, 2048)
    x = torch.randn(1, 2048)
    module = cpu_kernels.kernel_module()
    weight: quant.Weight = w.to(torch.bfloat16) if fmt == "bf16" else w
    if fmt.startswith("int"):
        weight = quant.quantize(w, fmt.split("-")[0])
        if fmt.endswith("packed"):
            if not quant.packs_on_cpu():
                pytest.skip("this CPU's kernels do not take packed weights")
            weight = weight.pack()

    def run() -> Any:
        if isinstance(weight, torch.Tensor):
            return module.linear_dense(x, weight, None)
        if weight.bits == 8:
            return module.linear_int8(x, weight.qweight, weight.scales, None)
        return module.linear_int4(x, weight.qweight, weight.scales, weight.mins, None)

    with ticking() as ticker:
        call = ticker.wrap(run)
        while ticker.calls < 20 or ticker.time_inside < 0.1:
            assert call() is not None
