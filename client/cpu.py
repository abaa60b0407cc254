"""CPU seconds a run costs, per process: the server's (tritonserver and each model's stubs,
found by process group in /proc: Linux only) and this process's own. A process that ends
between two readings takes its CPU seconds with it: the server's processes live as long as
the server."""

from __future__ import annotations

import os
import resource
from pathlib import Path

from pagedllm.serving.pytriton_wheel import stub_model

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _label(cmdline: list[str]) -> str:
    """`tritonserver`, or `stub:<model>` for a Python-backend stub (its first argument is the
    model's model.py: .../<model>/<version>/model.py)."""
    model = stub_model(cmdline)
    if model is not None:
        return "stub:" + model
    return Path(cmdline[0]).name if cmdline else "?"


def group_cpu(pgid: int) -> dict[str, float]:
    """User + system CPU seconds so far of every live process in process group `pgid`, summed
    by label."""
    out: dict[str, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) != pgid:  # fields[0] is the state: the pgid is the 5th
                continue
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, ValueError):  # gone meanwhile
            continue
        label = _label(cmdline)
        out[label] = out.get(label, 0.0) + (int(fields[11]) + int(fields[12])) / _TICK
    return out


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Seconds each label spent between two `group_cpu` readings."""
    return {k: round(after[k] - before.get(k, 0.0), 2) for k in sorted(after)}
