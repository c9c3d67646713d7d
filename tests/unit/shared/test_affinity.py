"""Which worker a sessionless chat that resends its history goes to first (prefix affinity), and
which worker the prefix index sends a request to (prefix_route)."""

from shared.affinity import conversation_home, prefix_route
from shared.schemas import FunctionCall, Message, ToolCall

WORKERS = frozenset({"w0", "w1", "w2"})


def conversation(n: int, turns: int) -> list[Message]:
    """Conversation `n` at its turn `turns` (1: the first question, no answer yet)."""
    messages = [Message(role="system", content="be brief")]
    for t in range(turns):
        messages.append(Message(role="user", content=f"conversation {n} question {t}"))
        if t < turns - 1:
            messages.append(Message(role="assistant", content=f"answer {n}.{t}"))
    return messages


def test_a_conversations_later_turns_all_go_to_one_worker() -> None:
    homes = {conversation_home(conversation(7, turns), WORKERS) for turns in range(2, 9)}
    assert len(homes) == 1 and homes <= WORKERS


def test_a_request_with_no_answer_in_it_goes_to_the_shared_queue() -> None:
    assert conversation_home(conversation(7, 1), WORKERS) is None
    # Several questions before any answer are not a resent conversation either.
    two_questions = [Message(role="user", content="a"), Message(role="user", content="b")]
    assert conversation_home([*two_questions, Message(role="assistant", content="c")], WORKERS) is None
    assert conversation_home(conversation(7, 3), frozenset()) is None


def test_conversations_spread_over_the_workers_and_a_leaving_worker_moves_only_its_own() -> None:
    before = {n: conversation_home(conversation(n, 3), WORKERS) for n in range(300)}
    counts = [sum(1 for home in before.values() if home == w) for w in sorted(WORKERS)]
    assert min(counts) > 60  # about 100 each
    after = {n: conversation_home(conversation(n, 3), WORKERS - {"w1"}) for n in range(300)}
    assert all(after[n] == home for n, home in before.items() if home != "w1")


def test_the_first_answers_tool_calls_are_part_of_the_key() -> None:
    def calling(arguments: str) -> list[Message]:
        call = ToolCall(id="c1", function=FunctionCall(name="f", arguments=arguments))
        return [
            Message(role="user", content="q"),
            Message(role="assistant", content="", tool_calls=[call]),
            Message(role="tool", content="r", tool_call_id="c1"),
        ]

    homes = {conversation_home(calling(f'{{"x": {i}}}'), WORKERS) for i in range(30)}
    assert len(homes) > 1


def test_the_route_prefers_the_longest_prefix_then_spills_past_the_load_margin() -> None:
    matches = {"w1": 10, "w2": 3, "w3": 0}
    first = prefix_route(matches=matches, loads={}, session_home=None, spill_seqs=2)
    assert first is not None and (first.home, first.reason) == ("w1", "cached_prefix")
    busy = prefix_route(matches=matches, loads={"w1": 2}, session_home=None, spill_seqs=2)
    assert busy is not None and (busy.home, busy.reason) == ("w2", "load_spill")  # the least loaded, most held first
    one_more = prefix_route(matches=matches, loads={"w1": 1}, session_home=None, spill_seqs=2)
    assert one_more is not None and one_more.home == "w1"  # within the margin: the cache wins
    both = prefix_route(matches={"w1": 10, "w2": 10}, loads={"w1": 1}, session_home=None, spill_seqs=2)
    assert both is not None and both.home == "w2"  # equal prefixes: the less loaded
    session = prefix_route(matches={"w1": 10, "w2": 10}, loads={"w1": 1}, session_home="w1", spill_seqs=2)
    assert session is not None and (session.home, session.reason) == ("w1", "session")
    # No worker holds any of it: today's rules.
    assert prefix_route(matches={"w1": 0, "w2": 0}, loads={}, session_home="w1", spill_seqs=2) is None
