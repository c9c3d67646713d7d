"""`axon up`: run the whole platform locally as three child processes.

The children share one console, each of their lines whole and prefixed with its process's name.
They run in sessions of their own, so a terminal's Ctrl+C reaches `axon up` alone. The first stop
signal (Ctrl+C, SIGTERM, or SIGHUP when the terminal closes) sends each child one SIGTERM and waits
for them to drain; a second belongs to the same request (a supervisor may follow a Ctrl+C with a
SIGTERM), a third kills them at once: the stop rule every Axon process keeps (`shared/stop_signals.py`).
"""

import asyncio
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import httpx

from services.cli.checks import check_dependencies, how_to_start, is_loopback, rabbitmq_binding_note
from services.cli.launcher import (
    PORT_VARIABLES,
    NotReadyInTime,
    PrefixedConsole,
    Service,
    ServiceExited,
    start_service,
    wait_ready,
)
from services.cli.local_key import LocalKey, admin_token_path, local_key_path, write_secret
from shared.migrations import migrate
from shared.serving import grace_s
from shared.settings import DEFAULT_MODEL, CommonSettings
from shared.stop_signals import StopSignals

LOOPBACK = "127.0.0.1"
# The order they start in, and the ports they listen on unless AXON_<KIND>_PORT says otherwise.
_DEFAULT_PORTS = {"worker": 8002, "sessions": 8001, "gateway": 8000}
# How often `axon up` asks the gateway whether `/v1/models` lists the model yet.
_LISTED_POLL_INTERVAL_S = 0.5
# How much longer than the gateway's own stop `axon up` waits for its children before killing them.
_STOP_MARGIN_S = 10.0
Say = Callable[[str], None]


class _StopRequests:
    """The signal handler of `axon up`: the first signal asks the children to stop, the second is
    only counted, the third kills them (at once, from the handler: the main thread may be waiting)."""

    # The terminal's Ctrl+C, a supervisor's stop, the terminal closing.
    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self._signals = StopSignals()
        self.requested = False
        self.ignored = 0
        self.forced = False
        self.children: list[Service] = []

    def install(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        action = self._signals.receive(signum)
        if action == "stop":
            self.requested = True
            return
        if action == "ignore":
            self.ignored += 1
            return
        self.forced = True
        for child in self.children:
            if child.exit_code is None:
                child.process.kill()


def _check_or_explain(settings: CommonSettings, say: Say) -> bool:
    results = asyncio.run(check_dependencies(settings))
    for result in results:
        if result.ok:
            say(f"{result.name} reachable at {result.url}")
        else:
            say(f"{result.name} is NOT reachable at {result.url} ({result.error})")
            say(f"  start it with: {how_to_start(result.name, result.url)}")
    note = rabbitmq_binding_note(settings.amqp_url)
    if note is not None:
        say(f"note: {note}")
    return all(r.ok for r in results)


class _StartProgress:
    """The console while the services start: each one as it gets ready, and at most every 5 s what one waits for."""

    def __init__(self, say: Say) -> None:
        self._say = say
        self._started = time.monotonic()
        self._last_report = 0.0

    def _elapsed_s(self) -> float:
        return time.monotonic() - self._started

    def ready(self, service: Service) -> None:
        self._say(f"{service.name} ready ({self._elapsed_s():.0f}s)")

    def waiting(self, service: Service, reason: str) -> None:
        if time.monotonic() - self._last_report > 5:
            self._say(f"waiting for {service.name}: {reason} ({self._elapsed_s():.0f}s)")
            self._last_report = time.monotonic()


def _child_environment() -> tuple[dict[str, str], bool]:
    """The children's environment, and whether the admin token was made for this run."""
    env = dict(os.environ)
    env.setdefault("AXON_LOG_FORMAT", "console")
    # A development platform with a key printed on the console: this machine only, unless asked.
    env.setdefault("AXON_HOST", LOOPBACK)
    # Their lines reach the console as they are written, not when a pipe's buffer fills.
    env.setdefault("PYTHONUNBUFFERED", "1")
    admin_token_generated = not env.get("AXON_ADMIN_TOKEN")
    if admin_token_generated:
        env["AXON_ADMIN_TOKEN"] = secrets.token_urlsafe(24)
    if not env.get("AXON_INTERNAL_TOKEN"):
        # The credential of the hops between this run's processes; nobody else needs it.
        env["AXON_INTERNAL_TOKEN"] = secrets.token_urlsafe(32)
    return env, admin_token_generated


def _examples(env: dict[str, str], key: LocalKey, *, admin_token: Path | None, terminal: bool) -> str:
    """What to do now. Secrets go to a terminal only: when the console is a file or a pipe (a log),
    it names the files that hold them instead. `admin_token`: the file of the admin token made for
    this run (None: the operator chose it)."""
    port = env.get("AXON_GATEWAY_PORT", "8000")
    scheme = "https" if env.get("AXON_TLS_CERTFILE") else "http"
    model = env.get("AXON_MODEL", DEFAULT_MODEL)
    admin_note = (
        f"Admin API token for this run (set AXON_ADMIN_TOKEN to choose your own), in {admin_token}, "
        f"readable by you only:\n  export AXON_ADMIN_TOKEN=$(cat {admin_token})\n"
        if admin_token is not None
        else ""
    )
    origin = "was created" if key.created else "is reused"
    key_value = key.key if terminal else f"$(cat {key.path})"
    host = env["AXON_HOST"]
    reach = (
        f"It listens on {host} only: set AXON_HOST=0.0.0.0 to reach it from other machines.\n"
        if is_loopback(host)
        else f"It listens on {host}: other machines can reach it.\n"
    )
    return f"""
Axon is up. Your local API key (tenant "local") {origin}; it is kept in {key.path}
(readable by you only) for the next `axon up`; `axon up --new-key` revokes it and makes another:

  export AXON_API_KEY={key_value}

Try it:

  curl -N {scheme}://127.0.0.1:{port}/v1/chat/completions \\
    -H "Authorization: Bearer $AXON_API_KEY" \\
    -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "stream": true, "temperature": 0,
         "messages": [{{"role": "user", "content": "Name the capital of France."}}]}}'

Or with the openai client: OpenAI(base_url="{scheme}://127.0.0.1:{port}/v1", api_key=os.environ["AXON_API_KEY"])
Or in the browser, with the key above: {scheme}://127.0.0.1:{port}/playground
More keys: .venv/bin/axon keys create --name NAME
{reach}{admin_note}
Press Ctrl+C to stop: the services finish what they are answering first; a third Ctrl+C stops them at once.

"""


def _listed(client: httpx.Client, url: str, model: str) -> bool:
    """Whether the gateway at `url` answers `GET /v1/models` with `model` in it."""
    try:
        response = client.get(f"{url}/v1/models")
        return response.status_code == 200 and any(m.get("id") == model for m in response.json()["data"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _wait_until_listed(
    children: list[Service], *, key: str, model: str, timeout_s: float, stop: _StopRequests, say: Say
) -> bool:
    """Until the gateway's `GET /v1/models` lists `model`, as a client's first request needs it
    (the services are ready before the worker's heartbeat has reached the registry and the session
    manager's list of live models): True then, False after `timeout_s` or at a stop request.

    Raises:
        ServiceExited: a child exited meanwhile.
    """
    gateway = next(child for child in children if child.name == "gateway")
    deadline = time.monotonic() + timeout_s
    told = False
    # Our own gateway on the loopback interface: its certificate names its public host, not 127.0.0.1.
    with httpx.Client(timeout=5, verify=False, headers={"Authorization": f"Bearer {key}"}) as client:
        while not stop.requested:
            if _listed(client, gateway.url, model):
                return True
            if exited := [child for child in children if child.exit_code is not None]:
                raise ServiceExited(exited[0])
            if time.monotonic() >= deadline:
                return False
            if not told:
                say(f"waiting for the gateway to list {model} in /v1/models")
                told = True
            time.sleep(_LISTED_POLL_INTERVAL_S)
    return False


def _run(
    children: list[Service],
    *,
    ready_timeout_s: float,
    key: str,
    model: str,
    stop: _StopRequests,
    say: Say,
    write: Say,
    examples: str,
) -> int:
    """Wait for the children to be ready and the gateway to list `model`, then watch them until a
    stop request: 0, or 1 if one failed first or the model was not listed within `ready_timeout_s`."""
    deadline = time.monotonic() + ready_timeout_s
    listed = False
    try:
        wait_ready(
            children,
            timeout_s=ready_timeout_s,
            poll_interval_s=0.5,
            progress=_StartProgress(say),
            stop_requested=lambda: stop.requested,
        )
        if not stop.requested:
            remaining_s = max(0.0, deadline - time.monotonic())
            listed = _wait_until_listed(children, key=key, model=model, timeout_s=remaining_s, stop=stop, say=say)
    except ServiceExited as exc:
        say(f"{exc.service.name} exited with code {exc.service.exit_code}; see its lines above")
        return 1
    except NotReadyInTime as exc:
        say(f"timed out waiting for: {', '.join(c.name for c in exc.pending)}")
        return 1
    if not stop.requested:
        if not listed:
            say(
                f"timed out: the gateway did not list {model} in /v1/models within {ready_timeout_s:.0f}s "
                "(--ready-timeout); see the worker's lines above"
            )
            return 1
        write(examples)
    while not stop.requested:
        for child in children:
            if child.exit_code is not None:
                say(f"{child.name} exited with code {child.exit_code}; stopping the platform")
                return 1
        time.sleep(0.2)
    return 0


def _stop_children(children: list[Service], *, stop: _StopRequests, drain_timeout_s: float, say: Say) -> bool:
    """One SIGTERM to each child still running, then wait for them all: the answers in flight get
    `drain_timeout_s` (`AXON_DRAIN_TIMEOUT_S`), the children are killed once the gateway's own wait
    has passed too (or at a third stop signal). Whether every one exited 0."""
    timeout_s = grace_s(drain_timeout_s, hops_behind=2) + _STOP_MARGIN_S
    say(
        f"stopping: the services finish what they are answering (up to {drain_timeout_s:g}s, AXON_DRAIN_TIMEOUT_S); "
        "Ctrl+C twice more stops them at once"
    )
    for child in reversed(children):
        child.terminate()
    deadline = time.monotonic() + timeout_s
    while any(child.exit_code is None for child in children) and not stop.forced:
        if time.monotonic() > deadline:
            say(f"still running after {timeout_s:.0f}s: killing them")
            break
        time.sleep(0.1)
    if stop.forced:  # the signal handler has killed them already
        say("third stop signal: killing the services")
    for child in children:
        child.kill()  # if it still runs; then reaped
        say(f"{child.name} exited with code {child.exit_code}")
    return all(child.exit_code == 0 for child in children)


def run_up(*, ready_timeout_s: float, new_key: bool) -> int:
    """Check dependencies, migrate, start the three services and keep them running until a stop request."""
    console = PrefixedConsole(list(_DEFAULT_PORTS))

    def say(message: str) -> None:
        console.write(f"axon: {message}\n")

    stop = _StopRequests()
    stop.install()  # from here on, Ctrl+C is a stop request: before the children start, it starts none
    settings = CommonSettings()
    if not _check_or_explain(settings, say):
        say("cannot start: a dependency above is not reachable")
        return 1
    applied = asyncio.run(migrate(settings.database_url))
    say(f"database ready ({len(applied)} migration(s) applied)")
    key = asyncio.run(LocalKey.obtain(settings, local_key_path(settings.namespace), replace=new_key))
    env, admin_token_generated = _child_environment()
    admin_token = admin_token_path(settings.namespace) if admin_token_generated else None
    if admin_token is not None:
        write_secret(admin_token, env["AXON_ADMIN_TOKEN"])
    children = stop.children
    try:
        for kind, default in _DEFAULT_PORTS.items():
            if not stop.requested:
                port = int(env.get(PORT_VARIABLES[kind], default))
                children.append(start_service(kind, env=env, port=port, console=console, own_session=True))
        status = _run(
            children,
            ready_timeout_s=ready_timeout_s,
            key=key.key,
            model=env.get("AXON_MODEL", DEFAULT_MODEL),
            stop=stop,
            say=say,
            write=console.write,
            examples=_examples(env, key, admin_token=admin_token, terminal=sys.stdout.isatty()),
        )
    finally:
        clean = _stop_children(children, stop=stop, drain_timeout_s=settings.drain_timeout_s, say=say)
    return status or (0 if clean else 1)
