"""services.worker.chunk_publisher: outputs that pile up during a publish go out as one chunk."""

import asyncio

from services.worker.chunk_publisher import Coalescer
from services.worker.engines import EngineOutput
from shared.schemas import TokenLogprob


async def test_outputs_added_meanwhile_are_merged_into_one() -> None:
    outputs = Coalescer()
    outputs.add(EngineOutput("Hel", 1, 5, 1, token_ids=(1,)))
    outputs.add(EngineOutput("lo", 1, 5, 2, finish_reason="stop", token_ids=(2,)))
    outputs.close()
    assert await outputs.take() == EngineOutput("Hello", 2, 5, 2, finish_reason="stop", token_ids=(1, 2))
    assert await outputs.take() is None


async def test_a_lone_output_goes_out_as_soon_as_it_exists() -> None:
    outputs = Coalescer()
    taken = asyncio.create_task(outputs.take())
    await asyncio.sleep(0)
    outputs.add(EngineOutput("Hi", 1, 5, 1))
    assert await asyncio.wait_for(taken, 1) == EngineOutput("Hi", 1, 5, 1)


async def test_merged_outputs_keep_every_logprob_and_the_latest_cached_count() -> None:
    prompt = (TokenLogprob(token="Say", logprob=-1.0),)
    first, second = TokenLogprob(token="Hel", logprob=-0.5), TokenLogprob(token="lo", logprob=-0.1)
    outputs = Coalescer()
    outputs.add(EngineOutput("Hel", 1, 5, 1, logprobs=(first,), prompt_logprobs=prompt, cached_tokens=2))
    outputs.add(EngineOutput("lo", 1, 5, 2, logprobs=(second,), cached_tokens=3))
    merged = await outputs.take()
    assert merged is not None
    assert (merged.text, merged.logprobs, merged.prompt_logprobs, merged.cached_tokens) == (
        "Hello",
        (first, second),
        prompt,
        3,
    )
