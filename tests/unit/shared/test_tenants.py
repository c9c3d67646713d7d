"""Tenants' weights without servers: what a weight may be (the admin API's body, the CLI's text)
and how the Redis hash writes it."""

import math

import pytest
from pydantic import ValidationError

from shared.errors import InvalidRequest, invalid_request
from shared.tenants import WeightChange, checked_tenant, checked_weight, weight_from_text, weight_text


@pytest.mark.parametrize("value", [1, 3, 0.5, 1e-6, 1_000_000, 2.75])
def test_a_positive_finite_number_up_to_a_million_is_a_weight(value: float) -> None:
    assert checked_weight(value) == value


@pytest.mark.parametrize(
    "value", [0, -1, -0.5, 1_000_000.5, math.nan, math.inf, -math.inf, "abc", "3", True, None, [2], {"w": 2}]
)
def test_anything_else_is_refused_naming_weight(value: object) -> None:
    with pytest.raises(InvalidRequest) as caught:
        checked_weight(value)
    assert caught.value.param == "weight" and caught.value.status_code == 400


def test_a_missing_weight_is_refused_naming_it_and_an_unknown_field_by_its_name() -> None:
    with pytest.raises(ValidationError) as missing:
        WeightChange.model_validate({})
    assert invalid_request(missing.value.errors()).param == "weight"
    with pytest.raises(ValidationError) as extra:
        WeightChange.model_validate({"weight": 2, "share": 3})
    refused = invalid_request(extra.value.errors())
    assert "share" in refused.message


@pytest.mark.parametrize(("text", "weight"), [("3", 3.0), ("0.5", 0.5), ("1e3", 1000.0), (" 2 ", 2.0)])
def test_the_command_line_takes_a_weight_as_text(text: str, weight: float) -> None:
    assert weight_from_text(text) == weight


@pytest.mark.parametrize("text", ["abc", "", "0", "-1", "nan", "inf", "Infinity", "1000001", "3x"])
def test_the_command_line_refuses_what_the_admin_api_refuses(text: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        weight_from_text(text)
    assert caught.value.param == "weight" and "weight" in caught.value.message


@pytest.mark.parametrize("tenant", ["", "x" * 129])
def test_a_tenant_has_one_to_128_characters(tenant: str) -> None:
    assert checked_tenant("x" * 128) == "x" * 128
    with pytest.raises(InvalidRequest) as caught:
        checked_tenant(tenant)
    assert caught.value.param == "tenant"


@pytest.mark.parametrize(
    ("weight", "text"), [(3.0, "3"), (1.0, "1"), (0.5, "0.5"), (1e-5, "1e-05"), (1_000_000.0, "1000000")]
)
def test_redis_holds_a_weight_as_the_decimal_lua_reads(weight: float, text: str) -> None:
    assert weight_text(weight) == text
    assert float(text) == weight
