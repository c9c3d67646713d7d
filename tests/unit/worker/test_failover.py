"""services.worker.failover: the token budget left to a resumed answer."""

from services.worker.engines import Resume
from services.worker.failover import remaining_sampling
from shared.schemas import Sampling


def test_a_resumed_answer_gets_what_is_left_of_max_tokens() -> None:
    rest = remaining_sampling(Sampling(max_tokens=10, temperature=0.5), Resume("Hello", (1, 2, 3), 3))
    assert rest is not None and (rest.max_tokens, rest.temperature) == (7, 0.5)


def test_a_resumed_answer_with_no_budget_left_ends_there() -> None:
    assert remaining_sampling(Sampling(max_tokens=3), Resume("Hello", (1, 2, 3), 3)) is None
