"""shared.schemas: the job and token chunk that cross service boundaries (docs/architecture.md, "Messages")."""

import json

import pytest
from pydantic import ValidationError

from shared.schemas import ChunkError, Job, Message, Sampling, TokenChunk, Usage


def make_job(**overrides: object) -> Job:
    fields: dict[str, object] = {
        "job_id": "job-1",
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Hello"}],
        "channel": "axon:tokens:job-1",
        "deadline": 1763790000.0,
    }
    fields.update(overrides)
    return Job.model_validate(fields)


# Sampling ---------------------------------------------------------------------------------


def test_sampling_leaves_the_model_defaults_unset() -> None:
    assert Sampling().model_dump() == {
        "max_tokens": 256,
        "temperature": None,
        "top_p": None,
        "top_k": None,
        "min_p": None,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": None,
        "logit_bias": {},
        "stop": [],
        "seed": None,
        "min_tokens": 0,
        "ignore_eos": False,
    }


@pytest.mark.parametrize("temperature", [0.0, 1.0, 2.0])
def test_sampling_accepts_temperature_in_range(temperature: float) -> None:
    assert Sampling(temperature=temperature).temperature == temperature


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": -0.01},
        {"temperature": 2.01},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"max_tokens": 0},
        {"top_k": -2},
    ],
)
def test_sampling_rejects_out_of_range(fields: dict[str, float]) -> None:
    with pytest.raises(ValidationError) as info:
        Sampling(**fields)
    assert info.value.errors()[0]["loc"] == (next(iter(fields)),)


def test_stop_lists_are_not_shared_between_instances() -> None:
    first = Sampling()
    first.stop.append("x")
    assert Sampling().stop == []


# Job --------------------------------------------------------------------------------------


def test_job_round_trip_via_json() -> None:
    job = make_job(sampling={"max_tokens": 5, "temperature": 0, "stop": ["\n"], "seed": 42})
    again = Job.model_validate_json(job.model_dump_json())
    assert again == job
    assert again.messages == [Message(role="user", content="Hello")]
    assert again.sampling.stop == ["\n"]
    assert again.sampling.seed == 42
    assert again.tenant == "anonymous"


def test_job_example_from_design_parses() -> None:
    body = (
        '{"job_id": "uuid", "model": "name", "messages": [{"role": "user", "content": "..."}],'
        ' "prompt": null, "sampling": {"max_tokens": 256, "temperature": 0.7, "top_p": 1.0, "top_k": -1,'
        ' "stop": [], "seed": null}, "channel": "<ns>:tokens:<job_id>", "deadline": 1763790000.0,'
        ' "session_id": null, "tenant": "key-id"}'
    )
    job = Job.model_validate_json(body)
    assert job.tenant == "key-id"
    assert job.deadline == 1763790000.0
    assert job.sampling == Sampling(temperature=0.7, top_p=1.0, top_k=-1)
    assert job.tools is None and job.response_format is None and job.logprobs is None


@pytest.mark.parametrize("missing", ["job_id", "model", "channel", "deadline"])
def test_job_requires_routing_fields(missing: str) -> None:
    fields = make_job().model_dump()
    del fields[missing]
    with pytest.raises(ValidationError):
        Job.model_validate(fields)


def test_job_rejects_unknown_role() -> None:
    with pytest.raises(ValidationError):
        make_job(messages=[{"role": "robot", "content": "hi"}])


def test_job_rejects_invalid_nested_sampling() -> None:
    with pytest.raises(ValidationError):
        make_job(sampling={"temperature": 3})


# TokenChunk -------------------------------------------------------------------------------


def test_chunk_seq_must_not_be_negative() -> None:
    assert TokenChunk(seq=0).seq == 0
    with pytest.raises(ValidationError):
        TokenChunk(seq=-1)
    with pytest.raises(ValidationError):
        TokenChunk(seq=0, n_tokens=-1)


@pytest.mark.parametrize("reason", ["stop", "length", "cancelled", "error"])
def test_chunk_with_finish_reason_is_final(reason: str) -> None:
    assert TokenChunk(seq=3, finish_reason=reason).is_final


def test_chunk_without_finish_reason_is_not_final() -> None:
    assert not TokenChunk(seq=3, text="abc", n_tokens=1).is_final


def test_chunk_rejects_unknown_finish_reason() -> None:
    with pytest.raises(ValidationError):
        TokenChunk(seq=0, finish_reason="eos")


def test_chunk_examples_from_design_parse() -> None:
    first = TokenChunk.model_validate_json('{"seq": 0, "text": "Hel", "n_tokens": 1, "finish_reason": null}')
    assert (first.seq, first.text, first.n_tokens, first.is_final) == (0, "Hel", 1, False)
    last = TokenChunk.model_validate_json(
        '{"seq": 17, "text": "", "n_tokens": 0, "finish_reason": "stop",'
        ' "usage": {"prompt_tokens": 21, "completion_tokens": 17}}'
    )
    assert last.is_final
    assert last.finish_reason == "stop"
    assert last.usage == Usage(prompt_tokens=21, completion_tokens=17)
    assert last.error is None


def test_error_chunk_round_trip() -> None:
    chunk = TokenChunk(seq=2, finish_reason="error", error=ChunkError(message="deadline passed", type="timeout_error"))
    data = json.loads(chunk.model_dump_json())
    assert data["error"] == {"message": "deadline passed", "type": "timeout_error", "param": None, "code": None}
    again = TokenChunk.model_validate_json(chunk.model_dump_json())
    assert again == chunk
    assert again.is_final


def test_error_chunk_names_the_parameter_and_code_of_an_engine_refusal() -> None:
    error = ChunkError(
        message="too long", type="invalid_request_error", param="messages", code="context_length_exceeded"
    )
    again = TokenChunk.model_validate_json(TokenChunk(seq=0, finish_reason="error", error=error).model_dump_json())
    assert again.error == error
    assert TokenChunk.model_validate_json('{"seq": 1, "error": {"message": "m"}}').error == ChunkError(message="m")


def test_minimal_chunk_fills_defaults() -> None:
    chunk = TokenChunk.model_validate_json('{"seq": 5}')
    assert (chunk.text, chunk.n_tokens, chunk.finish_reason, chunk.usage, chunk.error) == ("", 0, None, None, None)
