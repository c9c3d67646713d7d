"""benchmarks/profile_stack.py: py-spy's collapsed stacks read, each sample put in the stage of its
innermost frame that names one, and the flame graph drawn as well-formed SVG with its legend."""

import xml.dom.minidom
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]
START = ("<module> (axon-worker)", "main (services/worker/main.py)", "serve (shared/serving.py)")
PUMP = (*START, "_pump (services/worker/job_runner.py)", "publish (services/worker/chunk_publisher.py)")


@pytest.fixture(scope="module")
def profile() -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ROOT / "benchmarks"))  # the script imports engine_vs_stack.py beside it
        import profile_stack

        yield profile_stack


def test_collapsed_stacks_are_read_without_line_numbers(profile: ModuleType, tmp_path: Path) -> None:
    raw = tmp_path / "worker.txt"
    raw.write_text(
        "<module> (axon-worker:8);main (services/worker/main.py:40);f (shared/x.py:3) 5\n"
        "<module> (axon-worker:8);main (services/worker/main.py:41);f (shared/x.py:9) 2\n"
        " 1\n"
    )
    assert profile.read_collapsed(raw) == Counter(
        {("<module> (axon-worker)", "main (services/worker/main.py)", "f (shared/x.py)"): 7}
    )


def test_a_sample_is_the_stage_of_its_innermost_frame_that_names_one(profile: ModuleType) -> None:
    redis_call = (*PUMP, "_send (services/worker/chunk_publisher.py)", "evalsha (shared/redis_pipe.py)")
    assert profile.stage_of("worker", redis_call) == "publish (the Redis script)"
    assert profile.stage_of("worker", (*PUMP, "__init__ (pydantic/main.py)")) == "chunk building"
    assert profile.stage_of("worker", (*PUMP[:-1], "inc (prometheus_client/metrics.py)")) == "engine output handling"
    assert profile.stage_of("worker", (*START, "run (asyncio/runners.py)")) == profile.LOOP
    assert profile.stage_of("worker", (*START, "run (asyncio/runners.py)", "sleep (x/y.py)")) == profile.OTHER
    relayed = ("sse (services/sessions/chat/service.py)", "receive (services/sessions/active_request.py)")
    assert profile.stage_of("sessions", (*START, *relayed)) == "relay (pub/sub in, chunk parsed)"
    assert profile.stage_of("sessions", (*START, relayed[0], "dumps (orjson)")) == "SSE framing"
    shares = profile.stage_shares("worker", Counter({redis_call: 3, (*START, "run (asyncio/runners.py)"): 1}))
    assert shares["publish (the Redis script)"] == 0.75 and shares[profile.LOOP] == 0.25
    assert sum(shares.values()) == 1


def test_the_flame_graph_is_svg_with_each_frame_and_the_legend(profile: ModuleType) -> None:
    stacks = Counter({(*PUMP, "_send (services/worker/chunk_publisher.py)"): 30, (*START,): 10})
    svg = profile.flame_graph_svg("worker", stacks, "worker: sim <engine>")
    document = xml.dom.minidom.parseString(svg)
    titles = [t.firstChild.data for t in document.getElementsByTagName("title")]
    assert "_send (services/worker/chunk_publisher.py): 30 samples, 75.0 %" in titles
    assert "all: 40 samples, 100.0 %" in titles
    texts = [t.firstChild.data for t in document.getElementsByTagName("text")]
    assert texts[0] == "worker: sim <engine>" and "chunk building" in texts and profile.LOOP in texts
