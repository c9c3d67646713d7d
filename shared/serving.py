"""How every service runs its HTTP server: uvicorn, stopped by one stop request.

SIGINT and SIGTERM are the same request. The first one starts one graceful stop:

1. the service's drain hook, if it has one (the worker's: stop taking jobs, let the ones in
   flight finish within `AXON_DRAIN_TIMEOUT_S`, hand the rest back to the queue), while the
   server still answers its probes;
2. the server stops accepting connections and waits up to the stop's grace period for the
   requests it is answering;
3. at the end of the grace period the deadline hook ends what is still running (the session
   manager ends each stream with a `stream_interrupted` error event and `[DONE]`), and uvicorn
   gets `_CUT_MARGIN_S` more to write those ends.

A second signal is logged and ignored: a terminal's Ctrl+C reaches every process of its group,
and a supervisor in that group may then forward a SIGTERM of its own; both are one request (`axon
up` runs its children in sessions of their own and sends them its SIGTERM only). Only
a third signal forces: the process exits at once with status 1 (a worker's unacknowledged jobs go
back to their queue when its broker connection closes).

Each hop waits longer than the one behind it (`grace_s`): the session manager `HOP_MARGIN_S`
longer than a worker's drain, a gateway that again, so each sees the one behind it end its
requests before its own deadline.

Once started (imports, app, lifespan), the server collects the startup's garbage and freezes what
is left (`gc.freeze`): those objects live as long as the process, and left to the collector they
would be scanned again by every full collection, the first of which would otherwise fall among
the first requests (a pause of tens of ms on 100k objects, in front of their first tokens).
"""

import asyncio
import contextvars
import gc
import math
import signal
from collections.abc import Callable, Coroutine
from types import FrameType
from typing import Any

import uvicorn

from shared.logging import get_logger
from shared.stop_signals import StopAction, StopSignals, force_exit

log = get_logger(__name__)

Hook = Callable[[], Coroutine[Any, Any, None]]

# How much longer each hop waits than the hop behind it.
HOP_MARGIN_S = 5.0
# Time left to write the ends the deadline hook produced, before uvicorn cancels what remains.
_CUT_MARGIN_S = 2.0


def grace_s(drain_timeout_s: float, *, hops_behind: int) -> float:
    """How long a service waits for its requests when stopping: the drain timeout, plus
    `HOP_MARGIN_S` for each hop behind it (session manager 1, gateway 2), so that its wait
    covers theirs."""
    return drain_timeout_s + hops_behind * HOP_MARGIN_S


class GracefulServer(uvicorn.Server):
    """uvicorn's server with `StopSignals` in place of its own signal handling (which exits at
    the first signal, re-raises it after shutdown, and forces at a second SIGINT)."""

    def __init__(
        self,
        config: uvicorn.Config,
        *,
        drain: Hook | None,
        at_deadline: Hook | None,
        grace_s: float,
        drain_timeout_s: float | None = None,
        signals: StopSignals | None = None,
    ) -> None:
        super().__init__(config)
        self._drain = drain
        self._drain_timeout_s = drain_timeout_s
        self._at_deadline = at_deadline
        self._grace_s = grace_s
        self._signals = signals or StopSignals()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._cutting: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[Any] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        if self._signals.first is not None:  # asked while the service was starting
            self._loop.call_soon(self._on_signal, self._signals.first, "stop", context=contextvars.Context())
        await super().serve(sockets)

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets)
        gc.collect()
        gc.freeze()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The signal handler: it only counts and hands over to the event loop (a handler that
        logged could interrupt a write to stderr in progress)."""
        action = self._signals.receive(sig)
        if action == "force":
            force_exit(sig)
        if self._loop is not None:
            # In a context of its own: not that of whichever request the signal interrupted.
            self._loop.call_soon_threadsafe(self._on_signal, sig, action, context=contextvars.Context())

    def _on_signal(self, sig: int, action: StopAction) -> None:
        name = signal.Signals(sig).name
        if action == "ignore":
            log.info("stop_already_requested", signal=name, hint="a third signal stops at once")
            return
        # The drain's bound first (the worker's jobs: AXON_DRAIN_TIMEOUT_S), then the server's.
        bounds = {"grace_s": self._grace_s}
        if self._drain_timeout_s is not None:
            bounds = {"drain_timeout_s": self._drain_timeout_s, "then_grace_s": self._grace_s}
        log.info("stop_requested", signal=name, **bounds)
        self._stopping = asyncio.get_running_loop().create_task(self._stop())

    async def _stop(self) -> None:
        # The drain's steps wait on brokers that may be away for good: it gets its bound and
        # HOP_MARGIN_S more, then the stop goes on without it.
        bound = None if self._drain_timeout_s is None else self._drain_timeout_s + HOP_MARGIN_S
        try:
            if self._drain is not None:
                async with asyncio.timeout(bound):
                    await self._drain()
        except TimeoutError:
            log.warning("drain_timed_out", after_s=bound)
        except Exception:
            log.exception("drain_failed")
        finally:
            self.should_exit = True

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        timer = None
        if self._at_deadline is not None:
            timer = asyncio.get_running_loop().call_later(self._grace_s, self._deadline_passed)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()
            if self._cutting is not None:
                await self._cutting

    def _deadline_passed(self) -> None:
        assert self._at_deadline is not None
        log.info("stop_deadline_passed", connections=len(self.server_state.connections))
        self._cutting = asyncio.get_running_loop().create_task(self._at_deadline())


def serve(
    app: Any,
    *,
    host: str,
    port: int,
    grace_s: float,
    drain: Hook | None = None,
    drain_timeout_s: float | None = None,
    at_deadline: Hook | None = None,
    signals: StopSignals | None = None,
    **uvicorn_options: Any,
) -> None:
    """Run `app` until one stop request has drained it (see the module's docstring).

    Args:
        app: The ASGI app.
        host: Address to listen on.
        port: Port to listen on.
        grace_s: How long open requests may run once the server stops accepting connections.
        drain: Awaited first, while the server still answers (the worker's drain).
        drain_timeout_s: How long `drain` may take, if it has a bound: logged with the stop request
            (`drain_timeout_s`, then `then_grace_s` for the server's wait that follows it).
        at_deadline: Awaited when `grace_s` has passed with requests still open; it must end them.
        signals: The count `StopSignals.hold()` started before the service's imports, if any.
        uvicorn_options: Passed on to `uvicorn.Config` (`http`, `ssl_certfile`, `timeout_keep_alive` ...).
    """
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=math.ceil(grace_s + _CUT_MARGIN_S),
        **uvicorn_options,
    )
    GracefulServer(
        config,
        drain=drain,
        at_deadline=at_deadline,
        grace_s=grace_s,
        drain_timeout_s=drain_timeout_s,
        signals=signals,
    ).run()
