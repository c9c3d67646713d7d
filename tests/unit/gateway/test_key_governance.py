"""Key governance without servers: the model allowlist rule, what a completion reserves of its
key's budget, the admin API's validation of key changes (400 naming the field), the CLI's options
and the session manager's reading of the reservation header."""

import argparse
import datetime as dt

import pytest
from pydantic import ValidationError

from services.cli.keys import _update_values, parse_duration, parse_limit, parse_models, parse_time
from services.cli.main import build_parser
from services.gateway.api.admin import KeyCreate, KeyUpdate
from services.gateway.proxy import most_tokens
from services.sessions.deps import caller_from
from shared.errors import InvalidRequest, invalid_request
from shared.keys import KeyRecord, model_allowed
from shared.ratelimit import BudgetReservation

ALIASES = {"prod": "llama-8b", "chat": "llama-8b", "small": "smol"}


@pytest.mark.parametrize(
    ("name", "allowed", "expected"),
    [
        ("llama-8b", ["llama-8b"], True),
        ("prod", ["llama-8b"], True),  # allowing a model allows its aliases
        ("llama-8b", ["prod"], True),  # allowing an alias allows its target ...
        ("chat", ["prod"], True),  # ... and so the target's other aliases
        ("smol", ["prod"], False),
        ("small", ["llama-8b"], False),
        ("unknown", ["llama-8b", "prod"], False),
        ("unknown", ["unknown"], True),  # listed names pass even when nothing serves them yet
    ],
)
def test_an_allowlist_allows_served_models_whatever_name_they_are_asked_by(name, allowed, expected) -> None:
    assert model_allowed(name, allowed, ALIASES) is expected


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"max_tokens": 100}, 10 + 100),
        ({"max_completion_tokens": 50, "max_tokens": 100}, 10 + 50),
        ({}, 10 + 256),  # the session manager's default max_tokens
        ({"max_tokens": "100"}, 10 + 256),  # not an integer: the session manager refuses it
        ({"max_tokens": 0}, 10 + 256),
        ({"max_tokens": 10**9}, 10 + 8192),  # never more than the session manager allows
        ({"max_tokens": 100, "n": 3}, 10 + 300),  # every choice may use max_tokens
        ({"max_tokens": 100, "n": 10**6}, 10 + 100),
    ],
)
def test_a_completion_is_charged_its_prompt_estimate_and_max_tokens_per_choice(body, expected) -> None:
    assert most_tokens(body, 10, default_max_tokens=256, limit=8192) == expected


def _param(model: type, values: dict) -> str | None:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(values)
    return invalid_request(caught.value.errors()).param


@pytest.mark.parametrize(
    ("values", "param"),
    [
        ({"expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
        ({"expires_at": "2099-01-01T00:00:00"}, "expires_at"),  # no offset
        ({"expires_at": "tomorrow"}, "expires_at"),
        ({"allowed_models": []}, "allowed_models"),
        ({"allowed_models": ["ok", ""]}, "allowed_models.1"),
        ({"allowed_models": "llama"}, "allowed_models"),
        ({"token_budget": 0}, "token_budget"),
        ({"token_budget": 2**60}, "token_budget"),
        ({"budget_period": "week"}, "budget_period"),
        ({"rpm": -1}, "rpm"),
        ({"max_concurrent": 2**31}, "max_concurrent"),
        ({"priority": 10}, "priority"),
    ],
)
def test_bad_key_changes_are_refused_naming_the_field(values, param) -> None:
    assert _param(KeyUpdate, values) == param
    assert _param(KeyCreate, {"name": "k", **values}) == param


def test_unknown_fields_nulls_that_make_no_sense_and_empty_changes_are_refused() -> None:
    with pytest.raises(ValidationError) as caught:
        KeyUpdate.model_validate({"expires_in": "30d"})
    assert "Unrecognized request argument supplied: expires_in" in invalid_request(caught.value.errors()).message
    for field in ("name", "priority", "budget_period"):
        with pytest.raises(InvalidRequest) as refused:
            KeyUpdate.model_validate({field: None}).changes()
        assert refused.value.param == field
    with pytest.raises(InvalidRequest, match="Nothing to update"):
        KeyUpdate.model_validate({}).changes()


def test_changes_are_what_the_body_sets_null_clearing_a_limit_the_expiry_or_the_allowlist() -> None:
    changes = KeyUpdate.model_validate(
        {"rpm": None, "expires_at": None, "allowed_models": None, "token_budget": 500, "budget_period": "day"}
    ).changes()
    assert changes == {
        "allowed_models": None,
        "budget_period": "day",
        "expires_at": None,
        "rpm": None,
        "token_budget": 500,
    }
    assert KeyUpdate.model_validate({"allowed_models": ["a", "b", "a"]}).changes() == {"allowed_models": ["a", "b"]}


def test_cli_values() -> None:
    assert parse_duration("30d") == dt.timedelta(days=30)
    assert parse_duration("90m") == dt.timedelta(minutes=90)
    assert parse_duration("2w") == dt.timedelta(weeks=2)
    assert parse_time("2026-12-31T00:00:00Z") == dt.datetime(2026, 12, 31, tzinfo=dt.UTC)
    assert parse_models("a, b,,c") == ["a", "b", "c"]
    assert parse_limit("none") is None and parse_limit("12") == 12
    for parse, bad in (
        (parse_duration, "30"),
        (parse_duration, "0d"),
        (parse_duration, "3y"),
        (parse_time, "2026-12-31T00:00:00"),
        (parse_time, "soon"),
        (parse_models, " , "),
        (parse_limit, "0"),
        (parse_limit, "-3"),
    ):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)


def test_cli_update_sends_only_the_options_given() -> None:
    parser = build_parser()
    args = parser.parse_args(["keys", "update", "key_1", "--rpm", "none", "--budget", "900", "--all-models"])
    assert _update_values(args) == {"rpm": None, "token_budget": 900, "allowed_models": None}
    args = parser.parse_args(["keys", "update", "key_1", "--expires-in", "1h", "--allow-models", "a,b"])
    values = _update_values(args)
    assert values["allowed_models"] == ["a", "b"]
    assert abs((values["expires_at"] - dt.datetime.now(dt.UTC)).total_seconds() - 3600) < 5
    assert _update_values(parser.parse_args(["keys", "update", "key_1", "--no-expiry"])) == {"expires_at": None}
    for conflicting in (["--expires-in", "1h", "--no-expiry"], ["--allow-models", "a", "--all-models"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["keys", "update", "key_1", *conflicting])


def test_an_expired_record_is_expired_from_its_instant_on() -> None:
    at = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    record = KeyRecord.model_validate(
        {"id": "k", "name": "n", "tenant": "t", "display": "d", "limits": {}, "created_at": at, "expires_at": at}
    )
    assert not record.expired(at.timestamp() - 0.001)
    assert record.expired(at.timestamp())
    assert not record.model_copy(update={"expires_at": None}).expired(at.timestamp() + 10**9)


def _scope(**headers: str) -> dict:
    return {"headers": [(name.replace("_", "-").encode(), value.encode()) for name, value in headers.items()]}


def test_the_session_manager_reads_the_reservation_or_refuses_a_malformed_one() -> None:
    caller = caller_from(_scope(x_axon_tenant="t", x_axon_budget_reservation="d20261124:ab12:300"))
    assert caller.budget == BudgetReservation("d20261124", "ab12", 300)
    assert caller_from(_scope(x_axon_tenant="t")).budget is None
    with pytest.raises(InvalidRequest) as refused:
        caller_from(_scope(x_axon_tenant="t", x_axon_budget_reservation="lots"))
    assert refused.value.param == "x-axon-budget-reservation"
