"""Grammar compilation for the CPU engine (services/worker/engines/grammar.py): cache, refusals,
and the probe process that bounds a schema's compile time. A small vocabulary stands in for the model's."""

import asyncio
import dataclasses
import json
import time
from collections.abc import Iterator

import pytest
import xgrammar as xgr

from services.worker.engines.base import Guide, InvalidPrompt
from services.worker.engines.grammar import GrammarLimits, Grammars

VOCAB = ["<eos>", "{", "}", '"', "a", "b", ":", " ", "1", "2", ",", "[", "]", "x", "true", "null", "\n"]
PERSON = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


@pytest.fixture(scope="module")
def grammars() -> Iterator[Grammars]:
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[0])
    grammars = Grammars(info, blocked_ids=[], limits=GrammarLimits(compile_timeout_s=30, max_schema_bytes=2048))
    yield grammars
    grammars.close()


async def test_a_schema_compiles_once_and_its_matcher_follows_it(grammars: Grammars) -> None:
    hits, misses = grammars.hits, grammars.misses
    matcher = await grammars.matcher(Guide("json_schema", PERSON))
    assert grammars.misses == misses + 1
    assert matcher.accept_string('{"a": 12}') and matcher.is_completed()
    assert not (await grammars.matcher(Guide("json_schema", PERSON))).accept_string('{"b"')
    assert (grammars.hits, grammars.misses) == (hits + 1, misses + 1)


async def test_concurrent_requests_for_a_new_schema_share_one_compile(grammars: Grammars) -> None:
    misses = grammars.misses
    schema = json.dumps({"type": "array", "items": {"type": "integer"}})
    compiled = await asyncio.gather(*(grammars.compile(Guide("json_schema", schema)) for _ in range(4)))
    assert grammars.misses == misses + 1
    assert all(c is compiled[0] for c in compiled)


async def test_json_object_is_any_object_and_nothing_else(grammars: Grammars) -> None:
    matcher = await grammars.matcher(Guide("json_object"))
    assert matcher.accept_string('{"x": [1, true, null], "b": {}}')
    assert not (await grammars.matcher(Guide("json_object"))).accept_string("[")


async def test_invalid_and_oversized_schemas_are_refused_as_the_clients_fault(grammars: Grammars) -> None:
    with pytest.raises(InvalidPrompt, match='Unsupported type "objec"'):
        await grammars.compile(Guide("json_schema", '{"type": "objec"}'))
    with pytest.raises(InvalidPrompt, match="cannot be used"):
        await grammars.compile(Guide("json_schema", '{"type": '))
    big = json.dumps({"type": "object", "description": "x" * 3000})
    with pytest.raises(InvalidPrompt, match="at most 2048 bytes"):
        await grammars.compile(Guide("json_schema", big))


async def test_a_compile_past_the_time_limit_is_killed_refused_and_the_refusal_remembered(grammars: Grammars) -> None:
    await grammars.compile(Guide("json_schema", '{"type": "boolean"}'))  # the probe is up
    limits = grammars.limits
    grammars.limits = dataclasses.replace(limits, compile_timeout_s=0.0)  # past it before the reply can come
    try:
        slow = json.dumps({"type": "object", "properties": {"b": {"type": "string"}}})
        started = time.monotonic()
        with pytest.raises(InvalidPrompt, match="did not compile within"):
            await grammars.compile(Guide("json_schema", slow))
        assert time.monotonic() - started < 5  # not the compile's time: the probe was killed
    finally:
        grammars.limits = limits
    with pytest.raises(InvalidPrompt, match="did not compile within"):  # remembered, not compiled again
        await grammars.compile(Guide("json_schema", slow))
    # A new probe took over: other schemas still compile.
    assert (await grammars.matcher(Guide("json_schema", '{"type": "null"}'))).accept_string("null")


async def test_a_schema_waiting_for_the_probe_is_not_charged_the_wait(grammars: Grammars) -> None:
    """The probe compiles one new schema at a time: the time limit counts from when it starts on
    this one, not while it finishes those before it (concurrent new schemas were refused as too
    complex only for having queued behind each other)."""
    await grammars.compile(Guide("json_schema", '{"type": "integer"}'))  # the probe is up
    limits = grammars.limits
    grammars.limits = dataclasses.replace(limits, compile_timeout_s=1.0)
    lock = grammars._gate._probe._lock
    lock.acquire()  # another schema's compile, taking longer than the limit
    try:
        waiting = asyncio.create_task(grammars.compile(Guide("json_schema", '{"type": "array", "maxItems": 7}')))
        await asyncio.sleep(2.0)
        assert not waiting.done()
    finally:
        lock.release()
        grammars.limits = limits
    await waiting
