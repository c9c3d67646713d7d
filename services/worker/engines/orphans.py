"""Nothing of an engine outlives its worker: the processes it started are killed when the worker dies
without stopping them (SIGKILL, the OOM killer, a crash).

vLLM's engine core is a process of its own, and it survives a parent killed that way, keeping its
memory and spinning a core (vLLM issue 55510: its workers watch the engine core's death, the
engine core does not watch its parent's). A worker restarted by its supervisor would then share
the machine with a ghost engine. So after the engine starts, the worker hands the ids of the
processes it started to a small watcher process of its own session: the watcher reads them from a
pipe, and when the pipe ends without a goodbye (the worker is gone, however it went), it kills
every one still alive that is the same process (same start time, so a reused id is spared). A
worker that stops normally says goodbye after its engine stopped, and the watcher leaves.

Linux only (it reads /proc), where vLLM runs; elsewhere `ChildReaper.watching` watches nothing.
"""

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

_GOODBYE = "done"
# The watcher: no import of Axon (it must start in milliseconds and outlive the worker's venv state).
_WATCHER = f"""
import os, signal, sys
watched = []
for line in sys.stdin:
    if line.strip() == {_GOODBYE!r}:
        sys.exit(0)
    pid, started = line.split()
    watched.append((int(pid), started))
for pid, started in watched:
    try:
        with open(f"/proc/{{pid}}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[19] == started:
                os.kill(pid, signal.SIGKILL)
    except (OSError, IndexError):
        pass
"""


def _start_time(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[int]:
    """The processes `pid` started, and theirs, as /proc shows them now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found: list[int] = []
    todo = list(children.get(pid, ()))
    while todo:
        child = todo.pop()
        found.append(child)
        todo += children.get(child, ())
    return found


class ChildReaper:
    """The watcher of one worker's engine processes (see the module docstring)."""

    def __init__(self, watcher: subprocess.Popen[str] | None) -> None:
        self._watcher = watcher

    @classmethod
    def watching(cls, pids: Iterable[int]) -> "ChildReaper":
        """Start a watcher that kills `pids` if this process dies before `release()`."""
        if not sys.platform.startswith("linux"):
            return cls(None)
        watched = [(pid, started) for pid in pids if (started := _start_time(pid)) is not None]
        watcher = subprocess.Popen(
            [sys.executable, "-c", _WATCHER],
            stdin=subprocess.PIPE,
            text=True,
            start_new_session=True,  # not in the worker's process group: a group signal must not end it first
        )
        assert watcher.stdin is not None
        watcher.stdin.write("".join(f"{pid} {started}\n" for pid, started in watched))
        watcher.stdin.flush()
        return cls(watcher)

    def release(self) -> None:
        """The processes were stopped: the watcher leaves without killing anything."""
        watcher, self._watcher = self._watcher, None
        if watcher is None or watcher.stdin is None:
            return
        try:
            watcher.stdin.write(_GOODBYE + "\n")
            watcher.stdin.close()
        except OSError:
            pass  # it is gone already
        watcher.wait(timeout=5)
