"""What this machine is expected to have, and what a test does when something it needs is missing.

CI (`CI=true bash .ci/run`) on Linux x86-64 is the machine kind that must run every test: `make
install` installs vLLM's CPU build there, and the Redis, RabbitMQ and PostgreSQL server binaries of
the private-server tests are part of its image. A module or binary missing there fails the run,
saying what is missing. Anywhere else (a laptop, macOS, arm64) the tests needing it skip, with the
same words as the reason: never dropped silently.
"""

import os
import platform
import sys
from collections.abc import Mapping
from typing import NoReturn

import pytest


def must_run_everything(environ: Mapping[str, str] = os.environ) -> bool:
    """True in CI (`CI` set, not "false" or "0") on Linux x86-64."""
    in_ci = environ.get("CI", "").strip().lower() not in ("", "0", "false")
    return in_ci and (sys.platform, platform.machine()) == ("linux", "x86_64")


def missing(what: str) -> NoReturn:
    """Fail (CI on Linux x86-64) or skip (elsewhere) because `what` is missing on this machine.

    Args:
        what: what is missing, said as the reason, e.g. "no redis server binaries on this machine".
    """
    if must_run_everything():
        pytest.fail(f"{what}: CI on Linux x86-64 must have it (CI is set)", pytrace=False)
    pytest.skip(what, allow_module_level=True)
