"""The training benchmarks' worker processes (``benchmarks/training_runs.py``) do not
outlive the benchmark that started them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

PARENT = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
from training_runs import run_side_by_side

def sleeper(path):
    open(path, "w").write(str(os.getpid()))
    time.sleep(600)
    return {}

if __name__ == "__main__":
    run_side_by_side(sleeper, [(sys.argv[2],)], 1, print)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat")  # a zombie is dead, only not yet reaped
    return not (state.exists() and state.read_text().split(") ")[-1].startswith("Z"))


def test_a_killed_benchmark_takes_its_running_worker_down_with_it(tmp_path: Path) -> None:
    script, marker = tmp_path / "parent.py", tmp_path / "worker.pid"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), str(BENCHMARKS), str(marker)])
    try:
        deadline = time.monotonic() + 120
        while not (marker.exists() and marker.read_text()):
            assert parent.poll() is None, "the benchmark process ended before its worker ran"
            assert time.monotonic() < deadline, "the worker did not start within 120 s"
            time.sleep(0.1)
        worker = int(marker.read_text())
        assert alive(worker)
        parent.send_signal(signal.SIGKILL)  # no clean-up runs in the parent
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while alive(worker):
            assert time.monotonic() < deadline, f"worker {worker} outlived its benchmark by 10 s"
            time.sleep(0.1)
    finally:
        parent.kill()
        if marker.exists() and marker.read_text() and alive(int(marker.read_text())):
            os.kill(int(marker.read_text()), signal.SIGKILL)
