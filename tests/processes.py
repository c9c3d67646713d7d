"""The processes a test run started, found by what their environment carries (children inherit it,
so vLLM's engine core and a worker's other children are found with their parent)."""

import os
from pathlib import Path

# Set in this run's environment when pytest starts (tests/conftest.py), so every process the tests
# start carries it (launcher.environment_with passes everything but AXON_* settings on: so not
# an AXON_ name).
RUN_MARKER = "PYTEST_AXON_RUN_PID"


def processes_whose_environment_has(entry: str) -> list[int]:
    """Pids of the processes (this user's, Linux) whose environment holds `entry` ("NAME=value")."""
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    found = []
    wanted = entry.encode()
    for path in proc.iterdir():
        if path.name.isdigit():
            try:
                environ = (path / "environ").read_bytes()
            except OSError:
                continue
            if wanted in environ.split(b"\0"):
                found.append(int(path.name))
    return found


# Python's own helpers of a process using multiprocessing (torch does, in the test process): they
# end with pytest's process, after the check.
_OWN_HELPERS = ("from multiprocessing.resource_tracker import", "from multiprocessing.forkserver import")


def started_by_this_run() -> dict[int, str]:
    """The processes this run started that still run, with their command lines (pytest's own process
    and its multiprocessing helpers aside)."""
    left = {}
    for pid in processes_whose_environment_has(f"{RUN_MARKER}={os.getpid()}"):
        if pid == os.getpid():
            continue
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if not any(helper in command for helper in _OWN_HELPERS):
            left[pid] = command
    return left


def niceness(pid: int) -> dict[int, int]:
    """Each thread of process `pid` (Linux): its niceness (field 19 of /proc/<pid>/task/<tid>/stat)."""
    tasks = Path(f"/proc/{pid}/task")
    return {int(t.name): int((t / "stat").read_text().rsplit(")", 1)[1].split()[16]) for t in tasks.iterdir()}
