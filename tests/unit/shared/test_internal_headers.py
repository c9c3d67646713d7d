"""shared/internal_headers.py: the `x-axon-*` headers the gateway writes are the ones the session
manager reads, named and bounded as before."""

import datetime as dt

import pytest

from services.gateway.proxy import caller_of
from shared.errors import InvalidRequest
from shared.internal_headers import Caller, decode, encode
from shared.keys import KeyLimits, KeyRecord
from shared.ratelimit import BudgetReservation

FULL = Caller(
    tenant="acme",
    priority=7,
    key_id="key_0123",
    tpm_limit=5000,
    tpm_charged=268,
    lease_id="a1b2c3d4e5f60718",
    budget=BudgetReservation("d20261124", "ab12", 300),
)


def _scope(headers: dict[str, str]) -> dict:
    return {"headers": [(name.encode(), value.encode("latin-1")) for name, value in headers.items()]}


def test_the_gateway_writes_every_header_of_a_caller() -> None:
    assert encode(FULL) == {
        "x-axon-tenant": "acme",
        "x-axon-priority": "7",
        "x-axon-key-id": "key_0123",
        "x-axon-tpm-limit": "5000",
        "x-axon-tpm-charged": "268",
        "x-axon-lease-id": "a1b2c3d4e5f60718",
        "x-axon-budget-reservation": "d20261124:ab12:300",
    }


def test_a_key_without_limits_still_sends_its_priority_limit_and_charge() -> None:
    record = KeyRecord(
        id="key_1", name="n", tenant="t", display="ax-…", limits=KeyLimits(), created_at=dt.datetime.now(dt.UTC)
    )
    assert encode(caller_of(record)) == {
        "x-axon-tenant": "t",
        "x-axon-priority": "0",
        "x-axon-key-id": "key_1",
        "x-axon-tpm-limit": "0",
        "x-axon-tpm-charged": "0",
    }


@pytest.mark.parametrize("caller", [FULL, Caller(tenant="t"), Caller(tenant="t" * 128, priority=9, key_id="k" * 64)])
def test_the_session_manager_reads_back_what_the_gateway_wrote(caller: Caller) -> None:
    assert decode(_scope(encode(caller))) == caller


def test_absent_numbers_are_zero() -> None:
    assert decode(_scope({"x-axon-tenant": "t"})) == Caller(tenant="t")


T = {"x-axon-tenant": "t"}


@pytest.mark.parametrize(
    ("headers", "param", "message"),
    [
        ({}, "x-axon-tenant", "x-axon-tenant: a tenant of 1 to 128 characters is required."),
        ({"x-axon-tenant": ""}, "x-axon-tenant", None),
        ({"x-axon-tenant": "t" * 129}, "x-axon-tenant", None),
        (T | {"x-axon-key-id": "k" * 65}, "x-axon-key-id", "x-axon-key-id: at most 64 characters."),
        (T | {"x-axon-lease-id": "l" * 65}, "x-axon-lease-id", "x-axon-lease-id: at most 64 characters."),
        (
            T | {"x-axon-budget-reservation": "lots"},
            "x-axon-budget-reservation",
            "x-axon-budget-reservation: must be <period>:<id>:<tokens>.",
        ),
        (T | {"x-axon-priority": "10"}, "x-axon-priority", "x-axon-priority: must be 0 to 9."),
        (T | {"x-axon-priority": "-1"}, "x-axon-priority", None),
        (
            T | {"x-axon-tpm-limit": "1.5"},
            "x-axon-tpm-limit",
            "x-axon-tpm-limit: must be a whole number of at least 0.",
        ),
        (T | {"x-axon-tpm-charged": "many"}, "x-axon-tpm-charged", None),
    ],
)
def test_a_missing_or_out_of_range_header_is_refused_naming_it(
    headers: dict[str, str], param: str, message: str | None
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        decode(_scope(headers))
    assert refused.value.param == param
    if message is not None:
        assert refused.value.message == message
