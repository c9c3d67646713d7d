"""Which worker a sessionless chat that resends its history goes to first (prefix affinity)."""

from shared.affinity import conversation_home
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
