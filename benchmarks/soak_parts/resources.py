"""RSS, open file descriptors and threads of tritonserver, its Python backend stubs and the
gateway, read from /proc; snapshots during the soak and their growth per 1,000 requests."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def process_stats(pid: int) -> dict[str, Any] | None:
    """RSS (MiB), open file descriptors and threads of a live process (None once gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss_kib = int(fields.get("VmRSS", "0 kB").split()[0])
    return {
        "pid": pid,
        "rss_mib": round(rss_kib / 1024, 1),
        "fds": fds,
        "threads": int(fields["Threads"]),
    }


def stubs(server_pid: int) -> dict[str, int]:
    """The server's child processes (the Python backend stubs): instance name -> pid."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == server_pid:
            # the stub's argv: stub model.py shm-region sizes... parent-pid backend-dir N instance
            name = argv[8].decode() if len(argv) > 8 else f"child-{entry}"
            found[name] = int(entry)
    return found


def snapshot(server_pid: int, gateway_pid: int, requests: int, t0: float) -> dict[str, Any]:
    """Seconds since the load began, requests sent so far, and each process's stats: the server,
    its stubs (by instance name), the gateway, and `server_and_stubs` summed."""
    procs = {"tritonserver": process_stats(server_pid)}
    procs |= {name: process_stats(pid) for name, pid in sorted(stubs(server_pid).items())}
    alive = [p for p in procs.values() if p]
    procs["server_and_stubs"] = {
        "rss_mib": round(sum(p["rss_mib"] for p in alive), 1),
        "fds": sum(p["fds"] for p in alive),
        "threads": sum(p["threads"] for p in alive),
    }
    procs["gateway"] = process_stats(gateway_pid)
    return {"t_s": round(time.monotonic() - t0, 1), "requests": requests, "procs": procs}


def growth(samples: list[dict[str, Any]], midway: dict[str, Any]) -> dict[str, Any]:
    """Per process: RSS (MiB), fds and threads at the start, midway and the end of the soak,
    and the change per 1,000 requests over the whole soak and over its second half (the first
    requests also fill caches and allocator pools)."""
    first, last = samples[0], samples[-1]

    def per_1000(a: dict[str, Any], b: dict[str, Any], key: str, name: str) -> float | None:
        x, y = a["procs"].get(name), b["procs"].get(name)
        if not x or not y:
            return None
        return round((y[key] - x[key]) * 1000 / max(b["requests"] - a["requests"], 1), 2)

    out = {}
    for name, stats in first["procs"].items():
        ends = [s["procs"].get(name) or {} for s in (first, midway, last)]
        out[name] = {"pid": stats.get("pid")} if "pid" in stats else {}
        for key in ("rss_mib", "fds", "threads"):
            out[name][key] = [e.get(key) for e in ends]
        out[name]["rss_mib_per_1000_requests"] = per_1000(first, last, "rss_mib", name)
        out[name]["rss_mib_per_1000_requests_2nd_half"] = per_1000(midway, last, "rss_mib", name)
        out[name]["fds_per_1000_requests"] = per_1000(first, last, "fds", name)
    return out
