"""services.worker.engines.orphans: a worker killed with SIGKILL takes its engine's processes with it."""

import os
import signal
import subprocess
import sys
import time

import pytest

from services.worker.engines.orphans import descendants

# A stand-in worker: it starts a long-running child (as vLLM starts its engine core), has the
# watcher watch it, prints the child's pid, then either lives on or says goodbye first.
WORKER = """
import subprocess, sys, time
from services.worker.engines.orphans import ChildReaper, descendants
import os
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
reaper = ChildReaper.watching(descendants(os.getpid()))
if sys.argv[1] == "release":
    child.terminate(); child.wait(); reaper.release()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # not watched
print(child.pid, flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_worker(mode: str) -> tuple[subprocess.Popen[str], int]:
    worker = subprocess.Popen([sys.executable, "-c", WORKER, mode], stdout=subprocess.PIPE, text=True)
    assert worker.stdout is not None
    return worker, int(worker.stdout.readline())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the watcher reads /proc (Linux, where vLLM runs)")
def test_the_engines_processes_die_with_a_worker_killed_with_sigkill() -> None:
    worker, child = start_worker("watch")
    assert child in descendants(worker.pid)
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    deadline = time.monotonic() + 5
    while alive(child):
        assert time.monotonic() < deadline, "the engine's process outlived its worker"
        time.sleep(0.05)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the watcher reads /proc (Linux, where vLLM runs)")
def test_a_released_watcher_kills_nothing() -> None:
    worker, child = start_worker("release")
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    time.sleep(0.5)
    try:
        assert alive(child)  # the watcher had left: this process was never its to kill
    finally:
        os.kill(child, signal.SIGKILL)
