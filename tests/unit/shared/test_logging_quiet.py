"""Library chatter stays out of a service's log unless AXON_LOG_LEVEL=DEBUG asks for it."""

import logging
from collections.abc import Iterator

import pytest

from shared.logging import configure_logging

# The logger transformers' continuous batching writes its GPU notes and cache sizes to.
_BATCHING = "ContinuousBatchingLogger"


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root, batching = logging.getLogger(), logging.getLogger(_BATCHING)
    saved = (root.handlers[:], root.level, batching.handlers[:], batching.level, batching.propagate)
    yield
    root.handlers[:], root.level = saved[0], saved[1]
    batching.handlers[:], batching.level, batching.propagate = saved[2], saved[3], saved[4]


def test_batching_notes_are_dropped_and_its_warnings_written_as_our_lines(capsys: pytest.CaptureFixture[str]) -> None:
    batching = logging.getLogger(_BATCHING)
    batching.addHandler(logging.StreamHandler())  # what transformers adds when it is imported first
    configure_logging(service="worker", level="INFO", log_format="json")
    assert not batching.propagate  # so transformers, imported later, adds no handler of its own
    batching.info("Using cuda graphs for (varlen, decode) paths: (False, False)")
    batching.warning("the cache is full")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    assert '"event": "the cache is full"' in lines[0] and '"service": "worker"' in lines[0]


def test_debug_shows_them(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(service="worker", level="DEBUG", log_format="json")
    logging.getLogger(_BATCHING).info("Memory available for cache allocation: 4829 MB")
    assert "Memory available for cache allocation" in capsys.readouterr().err
