"""Steady streamed load for the fault tests, with every request's outcome classified.

Outcomes:
- `completed`: 200, the whole answer, `data: [DONE]`;
- `refused`: an HTTP error status with an OpenAI-shaped error body (e.g. 503 while a dependency is
  down): a clear error, before anything was accepted;
- `interrupted`: 200, then an error event and `data: [DONE]`: a clear error mid-stream;
- `lost`: anything else: a stream that ended without `[DONE]`, a broken connection, an error body
  that is not OpenAI's shape;
- `hung`: no answer within the request's deadline.

A fault test asserts `lost == hung == 0`, and reports its figures with `report` (run pytest with
`-s` to see them; docs/resilience.md collects them).
"""

import asyncio
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import orjson

OUTCOMES = ("completed", "refused", "interrupted", "lost", "hung")


def report(fault: str, **figures: object) -> None:
    """Print one fault or input class's figures as a `RESILIENCE {json}` line."""
    print(f"\nRESILIENCE {json.dumps({'fault': fault, **figures})}", flush=True)


@dataclass
class Outcome:
    kind: str
    started_s: float
    ended_s: float
    status: int = 0
    text: str = ""
    detail: str = ""


@dataclass
class Load:
    """Outcomes of every request sent, in the order they ended."""

    outcomes: list[Outcome] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        counted = Counter(o.kind for o in self.outcomes)
        return {"sent": len(self.outcomes), **{kind: counted.get(kind, 0) for kind in OUTCOMES}}

    def first_completed_after(self, moment_s: float) -> Outcome | None:
        started_after = [o for o in self.outcomes if o.kind == "completed" and o.started_s >= moment_s]
        return min(started_after, key=lambda o: o.ended_s, default=None)

    def problems(self) -> list[str]:
        return [f"{o.kind}: {o.status} {o.detail}" for o in self.outcomes if o.kind in ("lost", "hung")][:10]


async def stream_request(
    client: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str], *, deadline_s: float
) -> Outcome:
    """Send one streamed request and classify how it ended."""
    started = time.monotonic()

    def done(kind: str, status: int = 0, text: str = "", detail: str = "") -> Outcome:
        return Outcome(kind, started, time.monotonic(), status, text, detail)

    try:
        async with asyncio.timeout(deadline_s):
            async with client.stream("POST", url, json={**body, "stream": True}, headers=headers) as response:
                if response.status_code != 200:
                    raw = await response.aread()
                    try:
                        error = orjson.loads(raw)["error"]
                        shaped = set(error) == {"message", "type", "param", "code"}
                    except (orjson.JSONDecodeError, KeyError, TypeError):
                        shaped = False
                    return done(
                        "refused" if shaped else "lost", response.status_code, detail=raw[:200].decode(errors="replace")
                    )
                text, errored = [], None
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[6:]
                    if payload == "[DONE]":
                        return done("interrupted" if errored else "completed", 200, "".join(text), errored or "")
                    event = orjson.loads(payload)
                    if "error" in event:
                        errored = event["error"].get("code") or event["error"]["message"]
                    elif event.get("choices"):
                        text.append(event["choices"][0]["delta"].get("content") or "")
                return done("lost", 200, "".join(text), "stream ended without [DONE]")
    except TimeoutError:
        return done("hung", detail=f"no end within {deadline_s} s")
    except (httpx.HTTPError, OSError) as exc:
        return done("lost", detail=repr(exc)[:200])


async def steady(
    load: Load, send: Callable[[int, int], Awaitable[Outcome]], *, streams: int, stop: asyncio.Event
) -> None:
    """`streams` loops, each sending its next request when the previous one ends, until `stop`.
    `send(stream, n)` makes request `n` of `stream`. A refused request is retried after a pause."""

    async def loop(stream: int) -> None:
        n = 0
        while not stop.is_set():
            outcome = await send(stream, n)
            load.outcomes.append(outcome)
            n += 1
            if outcome.kind != "completed":
                await asyncio.sleep(0.1)

    await asyncio.gather(*(loop(s) for s in range(streams)))
