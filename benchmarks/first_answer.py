"""`make up` on a fresh clone to the first answer, cold and warm, and the worker's memory.

    .venv/bin/python benchmarks/first_answer.py          # ~6 min: a clone in a temporary folder, `make up` twice

Clones this repository's committed HEAD into a temporary folder and runs the README's `make up`
there twice, each time until the first chat answer, then Ctrl+C (SIGINT):

- cold: nothing installed in the clone (its `.venv` is made from scratch; pip's download cache is
  the machine's own, as on any machine that installed Python packages before) and an empty state
  folder (no key, the bundled model not converted yet);
- warm: the same clone again (installed, converted, the key kept).

Each run gets its own namespace, database and ports (removed at the end) and its own
`XDG_STATE_HOME`, so nothing of a running local stack is touched. Figures: seconds from `make up`
to the end of the install (the first line of `axon up`), to `Axon is up`, and to the first answer
(a chat request sent as soon as the key is printed); the worker's memory (RSS of the worker and
every process it started, vLLM's engine core included) after that answer; the venv's size.
"""

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from harness import _delete_namespace, _delete_topology

from services.cli import launcher
from shared.migrations import drop_database
from shared.settings import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[1]
KEY_LINE = re.compile(rb"export AXON_API_KEY=(\S+)")


def tree_rss_mb(pid: int) -> float:
    """RSS of `pid` and all its descendants, in MB."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    total_kb, todo = 0, [pid]
    while todo:
        current = todo.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
        except OSError:
            continue
        rss = re.search(r"VmRSS:\s+(\d+)", status)
        total_kb += int(rss.group(1)) if rss else 0
        todo += children.get(current, [])
    return total_kb / 1024


def listener_pid(port: int) -> int | None:
    out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, check=False).stdout
    found = re.search(r"pid=(\d+)", out)
    return int(found.group(1)) if found else None


def run_make_up(clone: Path, env: dict[str, str], label: str) -> dict[str, float]:
    started = time.monotonic()
    marks: dict[str, float] = {}
    process = subprocess.Popen(
        ["make", "up"], cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    assert process.stdout is not None
    key = None
    log = (clone.parent / f"make-up-{label}.log").open("wb")
    for line in process.stdout:
        log.write(line)
        now = time.monotonic() - started
        if "install" not in marks and b"reachable at" in line:
            marks["install"] = now
        if b"Axon is up" in line:
            marks["up"] = now
        if (found := KEY_LINE.search(line)) is not None:
            key = found.group(1).decode()
            break
    if key is None:
        process.wait()
        raise RuntimeError(f"make up ended without a key: {log.name}")
    answer = httpx.post(
        f"http://127.0.0.1:{env['AXON_GATEWAY_PORT']}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8},
        timeout=120,
    )
    marks["answer"] = time.monotonic() - started
    answer.raise_for_status()
    worker = listener_pid(int(env["AXON_WORKER_PORT"]))
    marks["worker_rss_mb"] = tree_rss_mb(worker) if worker else float("nan")
    os.killpg(process.pid, signal.SIGINT)
    for line in process.stdout:  # drain until the services stopped
        log.write(line)
    process.wait(timeout=120)
    log.close()
    return marks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", action="store_true", help="keep the clone (its logs: make-up-cold.log, -warm.log)")
    args = parser.parse_args()
    run_id = uuid.uuid4().hex[:10]
    folder = Path(tempfile.mkdtemp(prefix="axon-first-answer-"))
    clone = folder / "axon"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    namespace = f"axon_bench_{run_id}"
    database_url = f"postgresql://postgres@127.0.0.1:5432/axon_bench_{run_id}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AXON_", "VIRTUAL_ENV"))}
    env |= {
        "XDG_STATE_HOME": str(folder / "state"),
        "AXON_NAMESPACE": namespace,
        "AXON_DATABASE_URL": database_url,
        "AXON_GATEWAY_PORT": str(launcher.free_port()),
        "AXON_SESSIONS_PORT": str(launcher.free_port()),
        "AXON_WORKER_PORT": str(launcher.free_port()),
    }
    results = {}
    try:
        for label in ("cold", "warm"):
            print(f"make up ({label})...", file=sys.stderr, flush=True)
            results[label] = run_make_up(clone, env, label)
        du = subprocess.run(["du", "-sm", str(clone / ".venv")], capture_output=True, text=True, check=True)
        venv_mb = int(du.stdout.split()[0])
    finally:
        asyncio.run(drop_database(database_url))
        asyncio.run(_delete_namespace("redis://127.0.0.1:6379/0", namespace))
        asyncio.run(_delete_topology("amqp://guest:guest@127.0.0.1:5672/", namespace, {DEFAULT_MODEL}))
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    print(f"\n`make up` on a fresh clone of {head.stdout.strip()}, {os.cpu_count()} CPUs")
    print(f"{'run':<5} {'install s':>9} {'up s':>6} {'first answer s':>15} {'worker RSS MB':>14}")
    for label, marks in results.items():
        print(
            f"{label:<5} {marks.get('install', float('nan')):>9.0f} {marks.get('up', float('nan')):>6.0f} "
            f"{marks['answer']:>15.0f} {marks['worker_rss_mb']:>14.0f}"
        )
    print(f".venv: {venv_mb} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
