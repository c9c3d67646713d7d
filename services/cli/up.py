"""`axon up`: run the whole platform locally as three child processes."""

import asyncio
import os
import secrets
import signal
import time

import asyncpg

from services.cli.checks import HOW_TO_START, check_dependencies
from services.cli.launcher import (
    PORT_VARIABLES,
    NotReadyInTime,
    Service,
    ServiceExited,
    start_service,
    stop_all,
    wait_ready,
)
from shared.keys import KeyLimits, KeyRepository
from shared.migrations import migrate
from shared.settings import CommonSettings

# The order they start in, and the ports they listen on unless AXON_<KIND>_PORT says otherwise.
_DEFAULT_PORTS = {"worker": 8002, "sessions": 8001, "gateway": 8000}


def _start_children(env: dict[str, str]) -> list[Service]:
    return [
        start_service(kind, env=env, port=int(env.get(PORT_VARIABLES[kind], default)))
        for kind, default in _DEFAULT_PORTS.items()
    ]


def _say(message: str) -> None:
    print(f"axon: {message}", flush=True)


def _check_or_explain(settings: CommonSettings) -> bool:
    results = asyncio.run(check_dependencies(settings))
    for result in results:
        if result.ok:
            _say(f"{result.name} reachable at {result.url}")
        else:
            _say(f"{result.name} is NOT reachable at {result.url} ({result.error})")
            _say(f"  start it with: {HOW_TO_START[result.name]}")
    return all(r.ok for r in results)


class _StartProgress:
    """The console while the services start: each one as it gets ready, and at most every 5 s what one waits for."""

    def __init__(self) -> None:
        self._started = time.monotonic()
        self._last_report = 0.0

    def _elapsed_s(self) -> float:
        return time.monotonic() - self._started

    def ready(self, service: Service) -> None:
        _say(f"{service.name} ready ({self._elapsed_s():.0f}s)")

    def waiting(self, service: Service, reason: str) -> None:
        if time.monotonic() - self._last_report > 5:
            _say(f"waiting for {service.name}: {reason} ({self._elapsed_s():.0f}s)")
            self._last_report = time.monotonic()


def _wait_ready(children: list[Service], timeout_s: float) -> bool:
    try:
        wait_ready(children, timeout_s=timeout_s, poll_interval_s=0.5, progress=_StartProgress())
    except ServiceExited as exc:
        _say(f"{exc.service.name} exited with code {exc.service.exit_code}; see its log above")
        return False
    except NotReadyInTime as exc:
        _say(f"timed out waiting for: {', '.join(c.name for c in exc.pending)}")
        return False
    return True


async def _create_dev_key(settings: CommonSettings) -> str:
    """A fresh key for this local run (keys are shown once, so each run makes its own)."""
    pool = await asyncpg.create_pool(settings.database_url, min_size=1, max_size=1, timeout=10)
    try:
        limits = KeyLimits(
            rpm=settings.default_rpm, tpm=settings.default_tpm, max_concurrent=settings.default_max_concurrent
        )
        key, _record = await KeyRepository(pool).create(name="axon-up local", limits=limits, tenant="local")
        return key
    finally:
        await pool.close()


def _print_examples(env: dict[str, str], key: str, *, admin_token_generated: bool) -> None:
    port = env.get("AXON_GATEWAY_PORT", "8000")
    model = env.get("AXON_MODEL", "SmolLM2-135M-Instruct")
    admin_note = (
        f"Admin API token for this run (set AXON_ADMIN_TOKEN to choose your own): {env['AXON_ADMIN_TOKEN']}\n"
        if admin_token_generated
        else ""
    )
    print(
        f"""
Axon is up. An API key was created for this run (tenant "local"):

  export AXON_API_KEY={key}

Try it:

  curl -N http://127.0.0.1:{port}/v1/chat/completions \\
    -H "Authorization: Bearer $AXON_API_KEY" \\
    -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "stream": true, "temperature": 0,
         "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

Or with the openai client: OpenAI(base_url="http://127.0.0.1:{port}/v1", api_key=os.environ["AXON_API_KEY"])
Or in the browser, with the key above: http://127.0.0.1:{port}/playground
More keys: .venv/bin/axon keys create --name NAME
{admin_note}Press Ctrl+C to stop.
""",
        flush=True,
    )


def run_up(*, ready_timeout_s: float) -> int:
    """Check dependencies, migrate, start the three services and keep them running until Ctrl+C."""
    settings = CommonSettings()
    if not _check_or_explain(settings):
        _say("cannot start: a dependency above is not reachable")
        return 1
    applied = asyncio.run(migrate(settings.database_url))
    _say(f"database ready ({len(applied)} migration(s) applied)")
    key = asyncio.run(_create_dev_key(settings))
    env = dict(os.environ)
    env.setdefault("AXON_LOG_FORMAT", "console")
    admin_token_generated = not env.get("AXON_ADMIN_TOKEN")
    if admin_token_generated:
        env["AXON_ADMIN_TOKEN"] = secrets.token_urlsafe(24)
    if not env.get("AXON_INTERNAL_TOKEN"):
        # The credential of the hops between this run's processes; nobody else needs it.
        env["AXON_INTERNAL_TOKEN"] = secrets.token_urlsafe(32)
    children = _start_children(env)
    stopping = False

    def on_signal(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        if not _wait_ready(children, ready_timeout_s):
            return 1
        _print_examples(env, key, admin_token_generated=admin_token_generated)
        while not stopping:
            for child in children:
                if child.exit_code is not None:
                    _say(f"{child.name} exited with code {child.exit_code}; stopping the platform")
                    return 1
            time.sleep(0.5)
        return 0
    finally:
        _say("stopping")
        stop_all(children, timeout_s=40)
