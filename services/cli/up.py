"""`axon up`: run the whole platform locally as three child processes."""

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import asyncpg
import httpx

from services.cli.checks import HOW_TO_START, check_dependencies
from shared.keys import KeyLimits, KeyRepository
from shared.migrations import migrate
from shared.settings import CommonSettings


@dataclass(frozen=True, slots=True)
class Child:
    name: str
    module: str
    ready_url: str


def _children(env: dict[str, str]) -> list[Child]:
    gateway = env.get("AXON_GATEWAY_PORT", "8000")
    sessions = env.get("AXON_SESSIONS_PORT", "8001")
    worker = env.get("AXON_WORKER_PORT", "8002")
    return [
        Child("worker", "services.worker.main", f"http://127.0.0.1:{worker}/ready"),
        Child("sessions", "services.sessions.main", f"http://127.0.0.1:{sessions}/ready"),
        Child("gateway", "services.gateway.main", f"http://127.0.0.1:{gateway}/ready"),
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


def _wait_ready(children: list[Child], processes: dict[str, subprocess.Popen[bytes]], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    last_report = 0.0
    started = time.monotonic()
    with httpx.Client(timeout=2) as client:
        while pending and time.monotonic() < deadline:
            for child in list(pending):
                if processes[child.name].poll() is not None:
                    _say(f"{child.name} exited with code {processes[child.name].returncode}; see its log above")
                    return False
                try:
                    response = client.get(child.ready_url)
                except httpx.HTTPError:
                    continue
                if response.status_code == 200:
                    _say(f"{child.name} ready ({time.monotonic() - started:.0f}s)")
                    pending.remove(child)
                elif time.monotonic() - last_report > 5:
                    reason = response.json().get("reason", "starting")
                    _say(f"waiting for {child.name}: {reason} ({time.monotonic() - started:.0f}s)")
                    last_report = time.monotonic()
            time.sleep(0.5)
    if pending:
        _say(f"timed out waiting for: {', '.join(c.name for c in pending)}")
    return not pending


def _stop(processes: dict[str, subprocess.Popen[bytes]], timeout_s: float) -> None:
    for process in reversed(list(processes.values())):
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in processes.values():
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()


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
    children = _children(env)
    processes = {c.name: subprocess.Popen([sys.executable, "-m", c.module], env=env) for c in children}
    stopping = False

    def on_signal(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        if not _wait_ready(children, processes, ready_timeout_s):
            return 1
        _print_examples(env, key, admin_token_generated=admin_token_generated)
        while not stopping:
            for name, process in processes.items():
                if process.poll() is not None:
                    _say(f"{name} exited with code {process.returncode}; stopping the platform")
                    return 1
            time.sleep(0.5)
        return 0
    finally:
        _say("stopping")
        _stop(processes, timeout_s=40)
