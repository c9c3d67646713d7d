"""Jain's fairness index of what backlogged tenants were served between two polls (`queue_depth.py`)."""

import pytest

from services.sessions.queue_depth import jain_index
from shared.fair import BandState


def state(waiting: dict[str, int], served: dict[str, float]) -> BandState:
    return BandState(waiting=waiting, served=served)


def test_equal_weighted_service_is_one_and_one_tenant_taking_all_is_one_over_n() -> None:
    before = state({"a": 3, "b": 2, "c": 1}, {"a": 100.0, "b": 50.0, "c": 0.0})
    assert jain_index(before, state({"a": 1, "b": 1, "c": 1}, {"a": 200.0, "b": 150.0, "c": 100.0})) == 1.0
    assert jain_index(before, state({"a": 1, "b": 1, "c": 1}, {"a": 400.0, "b": 50.0, "c": 0.0})) == pytest.approx(
        1 / 3
    )


def test_only_tenants_backlogged_at_both_ends_count() -> None:
    before = state({"a": 3, "b": 2}, {"a": 0.0, "b": 0.0, "idle": 0.0})
    # "idle" was served but had nothing waiting before; "b" has nothing waiting now.
    after = state({"a": 1, "idle": 4}, {"a": 10.0, "b": 90.0, "idle": 500.0})
    assert jain_index(before, after) == 1.0  # one tenant backlogged all along: nothing to compare
    after = state({"a": 1, "b": 1}, {"a": 30.0, "b": 10.0})
    assert jain_index(before, after) == pytest.approx(40**2 / (2 * (30**2 + 10**2)))
