"""client/cpu.py: the CPU seconds of a process group, read from /proc, against what the
processes themselves report burning (their own resource.getrusage)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from client import cpu

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")

# burns about `seconds` of CPU, prints the CPU it used, then waits to be killed
BURN = """
import resource, sys, time
end = time.process_time() + float(sys.argv[1])
while time.process_time() < end:
    pass
u = resource.getrusage(resource.RUSAGE_SELF)
print(u.ru_utime + u.ru_stime, flush=True)
time.sleep(60)
"""


def test_group_cpu_counts_every_process_of_the_group() -> None:
    leader = subprocess.Popen(
        [sys.executable, "-c", BURN, "0.6"], stdout=subprocess.PIPE, text=True,
        process_group=0,  # a group of its own
    )  # fmt: skip
    member = subprocess.Popen(  # in the leader's group: counted too
        [sys.executable, "-c", BURN, "0.3"], stdout=subprocess.PIPE, text=True,
        process_group=leader.pid,
    )  # fmt: skip
    outsider = subprocess.Popen(  # in this test's group: not counted
        [sys.executable, "-c", BURN, "0.4"], stdout=subprocess.PIPE, text=True
    )
    try:
        reported = [float(p.stdout.readline()) for p in (leader, member, outsider)]  # type: ignore[union-attr]
        time.sleep(0.05)
        seen = cpu.group_cpu(leader.pid)
    finally:
        for p in (leader, member, outsider):
            p.kill()
            p.wait()
    label = cpu._label([sys.executable])
    assert set(seen) == {label}
    # /proc counts in clock ticks (10 ms): the two members' own reports, within a few ticks
    assert seen[label] == pytest.approx(reported[0] + reported[1], abs=0.05)


def test_labels_name_the_stubs_model() -> None:
    stub = "/opt/tritonserver/backends/python/triton_python_backend_stub"
    assert cpu._label([stub, "/srv/repo/detokenizer/1/model.py", "shm", ""]) == "stub:detokenizer"
    assert cpu._label(["/opt/tritonserver/bin/tritonserver", "--model-repository=x"]) == (
        "tritonserver"
    )


def test_spent_is_the_difference_per_label() -> None:
    before = {"tritonserver": 1.0, "stub:llm_engine": 5.0}
    after = {"tritonserver": 2.5, "stub:llm_engine": 9.0, "stub:tokenizer": 0.25}
    assert cpu.spent(before, after) == {
        "stub:llm_engine": 4.0, "stub:tokenizer": 0.25, "tritonserver": 1.5
    }  # fmt: skip
