"""sessions/job_publishing.py, job_building.py: a request's `n` jobs, published all or none, each choice's seed."""

import asyncio
import time
from typing import Any

import pytest

from services.sessions.job_building import for_choice
from services.sessions.job_publishing import publish_all
from services.sessions.relay import Inbox, TokenStream
from shared.errors import Unavailable
from shared.schemas import Job, Sampling


class Publisher:
    """Publishes by job id: fails the ids in `failures` with their exception."""

    def __init__(self, failures: dict[str, Exception]) -> None:
        self.failures = failures
        self.published: list[str] = []

    async def publish(
        self, job: Job, *, priority: int, request_id: str, home: str | None = None, headers: object = None
    ) -> None:
        await asyncio.sleep(0)
        if job.job_id in self.failures:
            raise self.failures[job.job_id]
        self.published.append(job.job_id)


class Pipe:
    """Keeps the cancel notices."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def submit(self, *command: Any) -> asyncio.Future[Any]:
        assert command[0] == "PUBLISH"
        self.cancelled.append(command[2])
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.set_result(1)
        return future


async def _publish(publisher: Publisher, pipe: Pipe, jobs: list[Job]) -> None:
    cancel = lambda job_id: pipe.submit("PUBLISH", "cancel", job_id)  # noqa: E731
    await publish_all(publisher, jobs, priority=0, request_id="r", home=None, cancel=cancel)  # type: ignore[arg-type]


def _job(job_id: str, seed: int | None = None) -> Job:
    return Job(
        job_id=job_id,
        model="m",
        prompt="p",
        channel=f"tokens:{job_id}",
        deadline=time.time() + 60,
        sampling=Sampling(seed=seed),
    )


QUEUE_FULL = Unavailable("full", code="queue_full")
UNCONFIRMED = Unavailable("no confirm")


async def test_all_jobs_are_published_and_nothing_is_cancelled() -> None:
    publisher, pipe = Publisher({}), Pipe()
    await _publish(publisher, pipe, [_job("a"), _job("b"), _job("c")])
    assert sorted(publisher.published) == ["a", "b", "c"] and pipe.cancelled == []


@pytest.mark.parametrize(
    ("failures", "cancelled"),
    [
        # The others were queued: they are called off; the refused one never was.
        ({"b": QUEUE_FULL}, ["a", "c"]),
        # Unconfirmed, it may be queued after all: called off too.
        ({"b": UNCONFIRMED}, ["a", "b", "c"]),
        ({"a": QUEUE_FULL, "b": QUEUE_FULL, "c": QUEUE_FULL}, []),
    ],
)
async def test_one_failed_publish_calls_the_other_choices_off(
    failures: dict[str, Exception], cancelled: list[str]
) -> None:
    publisher, pipe = Publisher(failures), Pipe()
    with pytest.raises(Unavailable):
        await _publish(publisher, pipe, [_job("a"), _job("b"), _job("c")])
    assert sorted(pipe.cancelled) == cancelled


@pytest.mark.parametrize(("failure", "cancelled"), [(QUEUE_FULL, []), (UNCONFIRMED, ["a"])])
async def test_a_single_job_is_called_off_only_if_it_may_be_queued(failure: Exception, cancelled: list[str]) -> None:
    publisher, pipe = Publisher({"a": failure}), Pipe()
    with pytest.raises(Unavailable) as raised:
        await _publish(publisher, pipe, [_job("a")])
    assert raised.value is failure and pipe.cancelled == cancelled


def _stream(job_id: str) -> TokenStream:
    return TokenStream(None, job_id, f"tokens:{job_id}", Inbox())  # type: ignore[arg-type]


def test_each_choice_has_its_job_id_channel_and_seed_plus_its_index() -> None:
    first = _job("a", seed=40)
    second = for_choice(first, 2, _stream("c"))
    assert (second.job_id, second.channel, second.sampling.seed) == ("c", "tokens:c", 42)
    assert second.prompt == first.prompt and first.sampling.seed == 40  # the first choice's job is unchanged
    unseeded = for_choice(_job("a"), 1, _stream("b"))
    assert unseeded.sampling.seed is None
    # Seeds stay 64-bit: the last one wraps around.
    assert for_choice(_job("a", seed=2**63 - 1), 1, _stream("b")).sampling.seed == -(2**63)
