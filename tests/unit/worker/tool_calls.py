"""What the tests of the worker's tool handling share: two tools, a job offering them, and an answer
as a client assembles it from a tool-call parser's output."""

import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.worker.engines.base import ToolCallParser
from services.worker.tool_parsers import AutoCallsParser, tool_call_id
from shared.schemas import FunctionCallDelta, FunctionSpec, Job, ToolCallDelta

WEATHER = FunctionSpec(
    name="get_weather",
    description="The weather in a city.",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
        "required": ["city", "unit"],
        "$defs": {"Unit": {"enum": ["c", "f"]}},
    },
)
TIME = FunctionSpec(name="get_time", parameters=None)


def job(**fields: Any) -> Job:
    return Job(job_id="job-1", model="m", channel="c", deadline=time.time() + 60, messages=[], **fields)


@dataclass
class Answer:
    """What a parser made of a text: its content and its calls as a client assembles them."""

    content: str = ""
    calls: dict[int, dict[str, str]] = field(default_factory=dict)

    def take(self, content: str, deltas: list[ToolCallDelta]) -> None:
        self.content += content
        indexes = [d.index for d in deltas]
        assert all(a != b for a, b in itertools.pairwise(indexes)), "one delta per call in a row"
        for delta in deltas:
            function = delta.function or FunctionCallDelta()
            if delta.index not in self.calls:
                # The first delta of a call carries its id, type and name.
                assert delta.id == tool_call_id("job-1", delta.index) and delta.type == "function"
                assert function.name
                self.calls[delta.index] = {"id": delta.id, "name": function.name, "arguments": ""}
            else:
                assert delta.id is None and function.name is None
            self.calls[delta.index]["arguments"] += function.arguments or ""

    def call_list(self) -> list[tuple[str, Any]]:
        return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(self.calls.items())]


def parse(make: Callable[[], ToolCallParser], text: str, pieces: list[str] | None = None) -> Answer:
    parser, answer = make(), Answer()
    for piece in pieces if pieces is not None else [text]:
        answer.take(*parser.feed(piece))
    answer.take(*parser.finish())
    return answer


def auto(single: bool = False) -> Callable[[], ToolCallParser]:
    return lambda: AutoCallsParser("job-1", single=single)
