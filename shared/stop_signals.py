"""Stop signals, counted from the first moment of a service's process.

SIGINT and SIGTERM are one stop request: the first one asks, the second belongs to it (a terminal's
Ctrl+C reaches every process of its group, and a supervisor in that group may forward a SIGTERM of
its own), a third exits at once. `axon up` runs its children in sessions of their own, so they get
its one SIGTERM only (and its SIGKILL at a third Ctrl+C). This module imports only the standard
library, so a service's `main` can start counting before its heavy imports: a stop requested while
it starts is a stop request like any other, not a `KeyboardInterrupt`. `shared/serving.py` takes the
count over when the server runs.
"""

import os
import signal
from types import FrameType
from typing import Literal

StopAction = Literal["stop", "ignore", "force"]

FORCED_EXIT_STATUS = 1


class StopSignals:
    """Counts stop signals: the first is the stop request, the second belongs to it, the third forces."""

    def __init__(self) -> None:
        self.received = 0
        # The first signal's number, once one came.
        self.first: int | None = None

    def receive(self, sig: int = signal.SIGTERM) -> StopAction:
        self.received += 1
        if self.received == 1:
            self.first = sig
            return "stop"
        return "ignore" if self.received == 2 else "force"

    @classmethod
    def hold(cls) -> "StopSignals":
        """Count SIGINT and SIGTERM from now on (a third exits at once) until a server takes them over."""
        signals = cls()

        def count(sig: int, _frame: FrameType | None) -> None:
            if signals.receive(sig) == "force":
                force_exit(sig)

        signal.signal(signal.SIGINT, count)
        signal.signal(signal.SIGTERM, count)
        return signals


def force_exit(sig: int) -> None:
    """Exit at once (from a signal handler: no logging, which could interrupt a write in progress)."""
    os.write(2, f"{signal.Signals(sig).name}: third stop signal, exiting at once\n".encode())
    os._exit(FORCED_EXIT_STATUS)
