"""services.worker.constraints: the guide a job's answer is constrained to."""

import json
from typing import Any

import jsonschema
import pytest

from services.worker.constraints import guide_for
from services.worker.engines.base import Guide, InvalidPrompt
from shared.schemas import FunctionSpec, JsonSchemaFormat, NamedToolChoice, ResponseFormat, Sampling
from tests.unit.worker.tool_calls import TIME, WEATHER, job


def test_a_job_without_tools_or_format_is_free_text() -> None:
    assert guide_for(job()) is None
    assert guide_for(job(response_format=ResponseFormat(type="text"))) is None
    assert guide_for(job(tools=[WEATHER])) is None  # auto: the text is parsed, not constrained


def test_response_formats_become_guides() -> None:
    assert guide_for(job(response_format=ResponseFormat(type="json_object"))) == Guide("json_object")
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    fmt = ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name="x", schema=schema))
    guide = guide_for(job(response_format=fmt))
    assert guide is not None and guide.kind == "json_schema" and guide.schema is not None
    assert json.loads(guide.schema) == schema
    assert list(json.loads(guide.schema)["properties"]) == ["b", "a"]  # the order answers follow


def test_a_json_schema_format_without_its_schema_is_refused() -> None:
    with pytest.raises(InvalidPrompt):
        guide_for(job(response_format=ResponseFormat(type="json_schema")))


def guided_schema(**fields: Any) -> dict[str, Any]:
    guide = guide_for(job(**fields))
    assert guide is not None and guide.kind == "json_schema" and guide.schema is not None
    schema: dict[str, Any] = json.loads(guide.schema)
    return schema


def test_required_is_an_array_of_calls_of_the_tools_with_their_defs_at_the_top() -> None:
    fmt = ResponseFormat(type="json_object")
    schema = guided_schema(tools=[WEATHER, TIME], tool_choice="required", response_format=fmt)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert schema["$defs"] == {"Unit": {"enum": ["c", "f"]}}
    branches = schema["items"]["anyOf"]
    assert [b["properties"]["name"] for b in branches] == [
        {"type": "string", "enum": ["get_weather"]},
        {"type": "string", "enum": ["get_time"]},
    ]
    assert "$defs" not in branches[0]["properties"]["parameters"]
    assert branches[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    validator = jsonschema.Draft202012Validator(schema)
    two = [
        {"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}},
        {"name": "get_time", "parameters": {}},
    ]
    assert validator.is_valid(two)
    assert not validator.is_valid([{"name": "get_weather", "parameters": {"city": "Paris", "unit": "k"}}])
    assert not validator.is_valid([{"name": "nope", "parameters": {}}])
    assert not validator.is_valid([])


def test_required_without_parallel_calls_allows_one_call() -> None:
    schema = guided_schema(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert schema["maxItems"] == 1
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid([{"name": "get_time", "parameters": {}}])
    assert not validator.is_valid([{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}])


def test_tools_defining_one_def_differently_are_refused() -> None:
    other = FunctionSpec(name="other", parameters={"type": "object", "$defs": {"Unit": {"type": "string"}}})
    with pytest.raises(InvalidPrompt, match=r"\$defs\.Unit"):
        guide_for(job(tools=[WEATHER, other], tool_choice="required"))
    same = FunctionSpec(name="same", parameters={"type": "object", "$defs": {"Unit": {"enum": ["c", "f"]}}})
    assert guide_for(job(tools=[WEATHER, same], tool_choice="required")) is not None


def test_a_named_tool_is_constrained_to_its_parameters() -> None:
    assert guided_schema(tools=[WEATHER, TIME], tool_choice=NamedToolChoice(name="get_weather")) == WEATHER.parameters
    assert guided_schema(tools=[WEATHER, TIME], tool_choice=NamedToolChoice(name="get_time")) == {
        "type": "object",
        "properties": {},
    }
    with pytest.raises(InvalidPrompt, match="nope"):
        guide_for(job(tools=[WEATHER], tool_choice=NamedToolChoice(name="nope")))


def test_a_schema_no_answer_within_max_tokens_can_follow_is_refused_naming_its_param() -> None:
    """The session manager refuses these first (shared/schema_bounds.py); a job it did not check is
    refused here rather than decoded toward an answer it cannot finish."""
    hostile = {"type": "array", "minItems": 10**9, "items": {"type": "string", "minLength": 10**9}}
    fmt = ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name="x", schema=hostile))
    with pytest.raises(InvalidPrompt, match=r"more than max_tokens \(16\)") as refused:
        guide_for(job(response_format=fmt, sampling=Sampling(max_tokens=16)))
    assert refused.value.param == "response_format"
    huge = FunctionSpec(
        name="huge",
        parameters={"type": "object", "properties": {"t": {"type": "string", "minLength": 5000}}, "required": ["t"]},
    )
    for choice in ("required", NamedToolChoice(name="huge")):
        with pytest.raises(InvalidPrompt) as refused:
            guide_for(job(tools=[huge], tool_choice=choice, sampling=Sampling(max_tokens=39)))
        assert refused.value.param == "tools"
        assert guide_for(job(tools=[huge], tool_choice=choice, sampling=Sampling(max_tokens=41))) is not None
