"""shared/schema_bounds.py: the shortest answer a JSON schema admits, and the admission check that
`max_tokens` can hold it (issue 29)."""

import math
import random
import time
from typing import Any

import jsonschema_rs
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.worker.engines.sim import json_instance
from shared.errors import InvalidRequest
from shared.openai_requests import ChatCompletionRequest, RequestLimits, parse_request
from shared.schema_bounds import MAX_TOKEN_CHARS, check_answer_fits, min_chars, min_tokens

ISSUE_29 = {"type": "array", "minItems": 1_000_000_000, "items": {"type": "string", "minLength": 1_000_000_000}}


def compact(value: Any) -> int:
    return len(orjson.dumps(value))


@pytest.mark.parametrize(
    ("schema", "shortest"),
    [
        ({}, 0),
        (True, 0),
        ({"type": "string"}, ""),
        ({"type": "string", "minLength": 5, "pattern": "^a+$"}, "aaaaa"),
        ({"type": ["string", "null"], "minLength": 9}, None),
        ({"type": "boolean"}, True),
        ({"enum": ["alpha", "be", 12345]}, "be"),
        ({"const": {"k": [1, 2]}}, {"k": [1, 2]}),
        ({"type": "array", "minItems": 3, "items": {"type": "integer"}}, [0, 0, 0]),
        ({"type": "array", "minItems": 2, "prefixItems": [{"type": "string", "minLength": 2}]}, ["aa", 0]),
        ({"type": "array", "items": {"type": "string", "minLength": 99}}, []),
        (
            {
                "type": "object",
                "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
                "required": ["city"],
            },
            {"city": ""},
        ),
        ({"type": "object", "minProperties": 1}, {"": 0}),
        (
            {"type": "object", "properties": {"long": {}, "a": {}}, "additionalProperties": False, "minProperties": 1},
            {"a": 0},
        ),
        ({"anyOf": [{"type": "string", "minLength": 1_000_000_000}, {"type": "integer"}]}, 0),
        ({"allOf": [{"type": "string", "minLength": 4}, {"maxLength": 8}]}, "aaaa"),
        # A tree: the recursion has a way out (no children).
        (
            {
                "type": "object",
                "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
                "required": ["v"],
            },
            {"v": 0},
        ),
        # A linked list that must hold two nodes.
        (
            {
                "$defs": {
                    "node": {
                        "anyOf": [
                            {"type": "null"},
                            {"type": "array", "prefixItems": [{"$ref": "#/$defs/node"}], "minItems": 1},
                        ]
                    }
                },
                "type": "array",
                "prefixItems": [{"$ref": "#/$defs/node"}],
                "minItems": 1,
            },
            [None],
        ),
    ],
)
def test_the_shortest_valid_answer_is_counted_exactly(schema: Any, shortest: Any) -> None:
    assert jsonschema_rs.validator_for(schema).is_valid(shortest)
    assert min_chars(schema) == compact(shortest)


@pytest.mark.parametrize(
    "schema",
    [
        False,
        {"enum": []},
        {"type": "string", "minLength": 3, "maxLength": 2},
        {"type": "array", "minItems": 1, "items": False},
        {"type": "array", "minItems": 4, "maxItems": 3},
        {"type": "object", "required": ["a"], "additionalProperties": False},
        {"type": "object", "properties": {"a": {}}, "additionalProperties": False, "minProperties": 2},
        {"$ref": "#"},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        # Every instance holds another: no finite one.
        {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        {"allOf": [{"type": "string"}, {"type": "array", "items": False, "minItems": 1}]},
    ],
)
def test_a_schema_nothing_finite_satisfies_has_no_bound(schema: Any) -> None:
    assert min_chars(schema) == math.inf


def test_the_schema_that_wedged_the_simulator_needs_more_than_any_context() -> None:
    # 1e9 strings of 1e9 characters, their quotes and commas, the brackets.
    assert min_chars(ISSUE_29) == 2 + 1_000_000_000 * (1_000_000_000 + 2) + 999_999_999
    assert min_tokens(min_chars(ISSUE_29)) > 10**15
    assert min_tokens(256.0) == 2 and min_tokens(257.0) == 3 and MAX_TOKEN_CHARS == 128


def test_references_cost_linear_time_however_they_branch() -> None:
    """40 levels of two-way choices through references: 2^40 paths, each level settled once."""
    defs: dict[str, Any] = {
        f"d{i}": {
            "anyOf": [
                {"$ref": f"#/$defs/d{i + 1}"},
                {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}, "minItems": 2},
            ]
        }
        for i in range(40)
    }
    defs["d40"] = {"type": "string", "minLength": 3}
    began = time.perf_counter()
    assert min_chars({"$defs": defs, "$ref": "#/$defs/d0"}) == 5
    assert time.perf_counter() - began < 1


def test_counts_of_any_size_are_read_whole() -> None:
    """Integers beyond a float's range (the request's check refuses them; a job may still carry
    one) and floats that are whole numbers."""
    assert min_chars({"type": "string", "minLength": 10**400}) == 2 + 10**400
    assert min_tokens(2 + 10**400) == -(-(2 + 10**400) // 128)
    assert min_chars({"type": "array", "minItems": 3.0}) == compact([0, 0, 0])


def test_a_reference_that_points_nowhere_or_outside_is_left_to_the_engine() -> None:
    assert min_chars({"type": "array", "minItems": 2, "items": {"$ref": "#/$defs/missing"}}) == 5
    assert min_chars({"type": "array", "minItems": 2, "items": {"$ref": "https://example.com/s.json"}}) == 5
    assert min_chars({"type": "array", "minItems": 2, "items": {"$ref": "#an-anchor"}}) == 5


# Schemas of the subset clients send, small enough for the simulator's generator to answer.
_LEAVES = st.sampled_from(
    [
        {"type": "string"},
        {"type": "string", "minLength": 3},
        {"type": "integer", "minimum": 10},
        {"type": "boolean"},
        {"type": "null"},
        {"enum": ["x", "yy", 7]},
        {"const": "fixed"},
    ]
)
_SCHEMAS = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(
        st.builds(lambda s, n: {"type": "array", "items": s, "minItems": n}, inner, st.integers(0, 3)),
        st.builds(
            lambda props, k: {
                "type": "object",
                "properties": {f"p{i}": p for i, p in enumerate(props)},
                "required": [f"p{i}" for i in range(min(k, len(props)))],
            },
            st.lists(inner, min_size=1, max_size=3),
            st.integers(0, 3),
        ),
        st.builds(lambda branches: {"anyOf": branches}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda branches: {"type": "object", "anyOf": branches}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda parts: {"allOf": parts}, st.lists(inner, min_size=1, max_size=2)),
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=_SCHEMAS, seed=st.integers(0, 2**32))
def test_no_valid_answer_is_shorter_than_the_bound(schema: dict[str, Any], seed: int) -> None:
    value = json_instance(schema, random.Random(seed))
    if jsonschema_rs.validator_for(schema).is_valid(value):
        assert compact(value) >= min_chars(schema)


# The admission check --------------------------------------------------------------------------


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    request = parse_request("chat", orjson.dumps(body), RequestLimits())
    assert isinstance(request, ChatCompletionRequest)
    return request


def schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def tool(name: str, parameters: Any = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **({"parameters": parameters} if parameters else {})}}


HUGE = {"type": "object", "properties": {"text": {"type": "string", "minLength": 100_000}}, "required": ["text"]}


def test_a_response_format_max_tokens_cannot_hold_is_refused_naming_it() -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_answer_fits(chat(response_format=schema_format(ISSUE_29)), 24)
    assert refused.value.param == "response_format"
    assert "more than max_tokens (24)" in refused.value.message
    # 100,011 characters: 782 tokens at 128 a token.
    check_answer_fits(chat(response_format=schema_format(HUGE)), 782)
    with pytest.raises(InvalidRequest, match="at least 100011 characters, at least 782 tokens"):
        check_answer_fits(chat(response_format=schema_format(HUGE)), 781)
    with pytest.raises(InvalidRequest, match="no JSON value of finite length") as refused:
        check_answer_fits(chat(response_format=schema_format({"$ref": "#"})), 4096)
    assert refused.value.param == "response_format"


def test_a_forced_tool_call_is_checked_and_wins_over_response_format() -> None:
    tools = [tool("small", {"type": "object"}), tool("huge", HUGE)]
    with pytest.raises(InvalidRequest) as refused:
        check_answer_fits(chat(tools=tools, tool_choice={"type": "function", "function": {"name": "huge"}}), 500)
    assert refused.value.param == "tools" and "'huge'" in refused.value.message
    # required: one call of the cheapest tool; a named call of the small one fits whatever the format.
    check_answer_fits(chat(tools=tools, tool_choice="required", response_format=schema_format(ISSUE_29)), 1)
    check_answer_fits(
        chat(
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "small"}},
            response_format=schema_format(ISSUE_29),
        ),
        1,
    )
    with pytest.raises(InvalidRequest) as refused:
        check_answer_fits(chat(tools=[tool("huge", HUGE)], tool_choice="required"), 500)
    assert refused.value.param == "tools"


def test_tools_the_model_may_leave_alone_are_not_checked() -> None:
    for choice in ("auto", "none"):
        check_answer_fits(chat(tools=[tool("huge", HUGE)], tool_choice=choice), 1)
    with pytest.raises(InvalidRequest):  # under `none` the response format constrains the answer
        check_answer_fits(chat(tools=[tool("f")], tool_choice="none", response_format=schema_format(ISSUE_29)), 1)
    check_answer_fits(chat(response_format={"type": "json_object"}), 1)
    check_answer_fits(parse_request("completion", b'{"model": "m", "prompt": "x"}', RequestLimits()), 1)


def test_a_branch_takes_its_parents_type_and_a_reference_ignores_its_siblings() -> None:
    # vLLM's schema of a required tool call: the branches say which properties, the parent `object`.
    branches = {
        "type": "object",
        "anyOf": [{"properties": {"a": {"type": "string", "minLength": 9}}, "required": ["a"]}],
    }
    assert min_chars(branches) == compact({"a": "123456789"})
    assert min_chars({"type": "string", "allOf": [{"minLength": 5}]}) == compact("12345")
    part = {"type": "string", "minLength": 3}
    assert min_chars({"allOf": [part, part]}) == compact("abc")  # one part twice is one constraint
    # Draft 7 ignores the siblings of `$ref`: a number is valid here.
    referring = {"definitions": {"n": {"type": "integer"}}, "$ref": "#/definitions/n", "type": "string"}
    assert min_chars(referring) == 1
