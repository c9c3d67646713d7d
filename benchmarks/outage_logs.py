"""What each service writes to its log while one dependency is away: Redis, RabbitMQ or PostgreSQL
cut for `--down-s` seconds (a TCP proxy between every service and that server drops its
connections and refuses new ones, as a server that stopped would), while one session chat a second
goes on. Per service, from the cut to `--after-s` seconds after its end: the lines written, those
other than the per-request access lines (`http_request`), the tracebacks, and the most frequent
events.

    .venv/bin/python benchmarks/outage_logs.py --dependency redis --down-s 10

Uses its own database and Redis namespace (`harness.BenchEnvironment`), removed at the end.
"""

import argparse
import asyncio
import collections
import json
import time
from collections.abc import Callable

import httpx

from benchmarks.harness import BenchEnvironment
from services.cli.launcher import Service
from tests.e2e.tcpproxy import TcpProxy

MODEL = "outage-sim"
URLS = {
    "redis": "redis_url",
    "rabbitmq": "amqp_url",
    "postgres": "postgres_url",
}


def log_summary(service: Service, since_line: int) -> dict[str, object]:
    lines = service.log_text().splitlines()[since_line:]
    events: collections.Counter[str] = collections.Counter()
    for line in lines:
        try:
            events[str(json.loads(line).get("event", "?"))[:60]] += 1
        except ValueError:
            events["(not JSON)"] += 1
    requests = events.pop("http_request", 0)
    return {
        "service": service.name,
        "lines": len(lines),
        "lines_other_than_http_request": len(lines) - requests,
        "bytes": sum(len(line) + 1 for line in lines),
        "tracebacks": sum("Traceback" in line for line in lines),
        "events": dict(events.most_common(12)),
    }


async def chat_and_cut(
    gateway: Service, key: str, proxy: TcpProxy, *, down_s: float, after_s: float, at_cut: Callable[[], None]
) -> dict[str, int]:
    """One session chat a second; after 3 s, `at_cut()` and the proxy cut for `down_s`. Returns
    how many chats got each status."""
    async with httpx.AsyncClient(base_url=gateway.url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
        session = (await http.post("/v1/sessions", json={})).json()["id"]
        statuses: collections.Counter[str] = collections.Counter()
        stop = asyncio.Event()

        async def chats() -> None:
            body = {
                "model": MODEL,
                "session_id": session,
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "hi"}],
            }
            while not stop.is_set():
                try:
                    statuses[str((await http.post("/v1/chat/completions", json=body)).status_code)] += 1
                except httpx.HTTPError as exc:
                    statuses[type(exc).__name__] += 1
                await asyncio.sleep(1)

        chatting = asyncio.create_task(chats())
        await asyncio.sleep(3)
        at_cut()
        cut_at = time.monotonic()
        await asyncio.to_thread(proxy.cut)
        await asyncio.sleep(down_s)
        await asyncio.to_thread(proxy.restore)
        print(f"cut for {time.monotonic() - cut_at:.1f} s", flush=True)
        await asyncio.sleep(after_s)
        stop.set()
        await chatting
    return dict(statuses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dependency", choices=sorted(URLS), required=True)
    parser.add_argument("--down-s", type=float, default=10.0)
    parser.add_argument("--after-s", type=float, default=3.0)
    args = parser.parse_args()
    server_url = getattr(BenchEnvironment, URLS[args.dependency])
    proxy = TcpProxy.to(server_url)
    try:
        with BenchEnvironment(**{URLS[args.dependency]: proxy.proxied(server_url)}) as env:
            services = env.start_stack({"AXON_ENGINE": "sim", "AXON_MODEL": MODEL, "AXON_SIM_ITL_MS": "5"})
            key = env.create_key()
            before: dict[str, int] = {}

            def at_cut() -> None:
                before.update({name: len(service.log_text().splitlines()) for name, service in services.items()})

            statuses = asyncio.run(
                chat_and_cut(services["gateway"], key, proxy, down_s=args.down_s, after_s=args.after_s, at_cut=at_cut)
            )
            for name, service in services.items():
                print(json.dumps({"dependency": args.dependency, **log_summary(service, before[name])}))
            print(json.dumps({"dependency": args.dependency, "down_s": args.down_s, "chats": statuses}))
    finally:
        proxy.close()


if __name__ == "__main__":
    main()
