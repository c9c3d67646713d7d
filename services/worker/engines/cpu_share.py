"""How vLLM's engine shares a CPU machine with the platform's services.

On CPU the engine's threads compute on every core the worker may use (`VLLM_CPU_OMP_THREADS_BIND`),
where the gateway, the session manager, the worker's own event loop, Redis and RabbitMQ run too.
Each token the engine makes wakes those processes one after another, and at equal priority each
wake-up waits for the engine's threads to be preempted: the hops' latency grows with the engine's
load. `AXON_ENGINE_NICE` lowers the engine's priority instead, so a woken service runs at once
and the engine gets every cycle the services leave (docs/performance.md measures it).

Niceness belongs to each thread on Linux (`setpriority` of a process id changes its first thread
only), and a thread starts with its creator's: so every thread of every engine process is set once
the engine has started, and the threads they start later inherit it.
"""

import os
from collections.abc import Iterable


def renice(pids: Iterable[int], nice: int) -> int:
    """Set the niceness of every thread of the processes `pids` to `nice`; returns how many threads
    were set (a process or thread that ended meanwhile is skipped)."""
    count = 0
    for pid in pids:
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for thread in threads:
            try:
                os.setpriority(os.PRIO_PROCESS, int(thread), nice)
            except (ProcessLookupError, FileNotFoundError):
                continue
            count += 1
    return count
