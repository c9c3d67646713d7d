"""services.worker.engines.cpu_share: the engine's processes at a lower priority, against real
processes and threads (Linux's /proc)."""

import os
import subprocess
import sys

import pytest

from services.worker.engines.cpu_share import renice
from services.worker.settings import WorkerSettings
from tests.processes import niceness

# Starts a thread, says so, and on a line from its parent starts another and says so again.
_THREADS = """
import sys, threading
stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()
print("one", flush=True)
sys.stdin.readline()
threading.Thread(target=stop.wait, daemon=True).start()
print("two", flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_every_thread_is_set_and_a_thread_started_later_inherits_it() -> None:
    children = [
        subprocess.Popen([sys.executable, "-c", _THREADS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        for child in children:
            assert child.stdout is not None and child.stdout.readline() == "one\n"
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert all(set(niceness(c.pid).values()) == {ours} and len(niceness(c.pid)) == 2 for c in children)

        assert renice([c.pid for c in children], 19) == 4

        for child in children:
            assert niceness(child.pid) and set(niceness(child.pid).values()) == {19}
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.stdout.readline() == "two\n"
            assert len(niceness(child.pid)) == 3 and set(niceness(child.pid).values()) == {19}
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_a_process_gone_is_skipped() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert renice([gone.pid], 5) == 0


@pytest.mark.parametrize("nice", [-1, 20])
def test_the_setting_is_a_niceness_the_engine_can_be_lowered_to(nice: int) -> None:
    assert WorkerSettings(engine="vllm").engine_nice == 10
    with pytest.raises(ValueError, match="engine_nice"):
        WorkerSettings(engine="vllm", engine_nice=nice)
