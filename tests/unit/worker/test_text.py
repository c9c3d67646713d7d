"""services.worker.engines.text: stop strings and incremental detokenization."""

from collections.abc import Sequence

import pytest

from services.worker.engines.text import IncrementalDetokenizer, StopMatcher

# StopMatcher ------------------------------------------------------------------------------


def feed_all(matcher: StopMatcher, pieces: Sequence[str]) -> list[str]:
    """Feed pieces until the matcher stops; return what it emitted for each piece."""
    out = []
    for piece in pieces:
        out.append(matcher.feed(piece))
        if matcher.stopped:
            break
    return out


def test_no_stops_is_passthrough() -> None:
    matcher = StopMatcher([])
    assert [matcher.feed(p) for p in ["Hel", "lo", " wor", "ld"]] == ["Hel", "lo", " wor", "ld"]
    assert matcher.flush() == ""
    assert not matcher.stopped


def test_empty_stop_strings_are_ignored() -> None:
    matcher = StopMatcher([""])
    assert matcher.feed("abc") == "abc"
    assert not matcher.stopped


def test_stop_inside_one_piece_cuts_before_it() -> None:
    matcher = StopMatcher(["END"])
    assert matcher.feed("hello END world") == "hello "
    assert matcher.stopped


def test_stop_split_across_feeds_is_cut_and_never_emitted() -> None:
    matcher = StopMatcher(["</s>"])
    emitted = feed_all(matcher, ["Hi there", "<", "/", "s", ">", " never"])
    assert matcher.stopped
    joined = "".join(emitted)
    assert joined == "Hi there"
    # No prefix of the stop string ever left the matcher.
    assert all("<" not in piece for piece in emitted)
    assert matcher.flush() == ""


def test_stop_at_the_very_start() -> None:
    matcher = StopMatcher(["\n\n"])
    assert feed_all(matcher, ["\n", "\nmore"]) == ["", ""]
    assert matcher.stopped


def test_text_resembling_a_stop_prefix_is_eventually_emitted() -> None:
    matcher = StopMatcher(["STOP"])
    emitted = feed_all(matcher, ["ST", "O", "RY time", " and more text"])
    assert not matcher.stopped
    assert "".join(emitted) + matcher.flush() == "STORY time and more text"
    # Held text is released once enough has been generated to rule the stop out.
    assert "".join(emitted).startswith("STORY")


def test_held_text_is_at_most_the_longest_stop_minus_one() -> None:
    matcher = StopMatcher(["abcdef", "xy"])
    emitted = matcher.feed("0123456789")
    assert emitted == "01234"
    assert matcher.flush() == "56789"


def test_flush_returns_held_text_then_nothing() -> None:
    matcher = StopMatcher(["###"])
    assert matcher.feed("ab#") == "a"  # the last len("###") - 1 characters are held
    assert matcher.feed("#") == "b"
    assert matcher.flush() == "##"
    assert matcher.flush() == ""
    assert not matcher.stopped


def test_earliest_of_several_stops_wins() -> None:
    matcher = StopMatcher(["world", "lo"])
    assert matcher.feed("hello world") == "hel"
    assert matcher.stopped


def test_stop_completed_by_later_feed_after_partial_emission() -> None:
    matcher = StopMatcher(["User:"])
    emitted = feed_all(matcher, ["Sure, here it is.\n", "Us", "er", ": next question"])
    assert "".join(emitted) == "Sure, here it is.\n"
    assert matcher.stopped


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 5, 7])
def test_result_does_not_depend_on_how_text_is_split(chunk_size: int) -> None:
    text = "alpha beta <|end|> gamma"
    pieces = [text[i : i + chunk_size] for i in range(0, len(text), chunk_size)]
    matcher = StopMatcher(["<|end|>", "zzz"])
    emitted = "".join(feed_all(matcher, pieces))
    assert matcher.stopped
    assert emitted == "alpha beta "


# IncrementalDetokenizer -------------------------------------------------------------------

# A byte-level vocabulary: "é" is two tokens and "🙂" is four, as in real BPE tokenizers.
VOCAB: dict[int, bytes] = {
    1: b"Caf",
    2: b"\xc3",  # first byte of "é"
    3: b"\xa9",  # second byte of "é"
    4: b" ",
    5: b"\xf0",  # "🙂" = f0 9f 99 82
    6: b"\x9f",
    7: b"\x99",
    8: b"\x82",
    9: b"!",
    10: b"ok",
}


def fake_decode(token_ids: Sequence[int]) -> str:
    """Decode like a tokenizer: an incomplete trailing character becomes U+FFFD."""
    return b"".join(VOCAB[t] for t in token_ids).decode("utf-8", errors="replace")


def stream(token_ids: Sequence[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(fake_decode)
    return [detokenizer.step(token_ids[: n + 1]) for n in range(len(token_ids))]


def test_fake_decode_marks_a_split_character() -> None:
    # Guard: the fake really does produce U+FFFD mid-character, as the detokenizer expects.
    assert fake_decode([1, 2]) == "Caf\ufffd"


def test_deltas_join_to_the_full_text_without_replacement_characters() -> None:
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    deltas = stream(ids)
    assert "".join(deltas) == "Café 🙂!"
    assert all("\ufffd" not in d for d in deltas)


def test_incomplete_character_is_held_until_complete() -> None:
    deltas = stream([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert deltas[0] == "Caf"
    assert deltas[1] == ""  # only the first byte of "é"
    assert deltas[2] == "é"
    assert deltas[4:7] == ["", "", ""]  # three of the four bytes of "🙂"
    assert deltas[7] == "🙂"
    assert deltas[8] == "!"


def test_ascii_tokens_come_out_one_delta_each() -> None:
    assert stream([10, 4, 10, 9]) == ["ok", " ", "ok", "!"]


def test_sequence_ending_mid_character_emits_no_replacement_character() -> None:
    deltas = stream([1, 4, 5, 6])
    assert "".join(deltas) == "Caf "
    assert all("\ufffd" not in d for d in deltas)


def test_repeated_step_with_same_tokens_emits_nothing_new() -> None:
    detokenizer = IncrementalDetokenizer(fake_decode)
    assert detokenizer.step([1]) == "Caf"
    assert detokenizer.step([1]) == ""
    assert detokenizer.step([1, 9]) == "!"


def test_decodes_only_a_short_window() -> None:
    # The detokenizer must not re-decode the whole sequence every step.
    longest: list[int] = []

    def recording_decode(token_ids: Sequence[int]) -> str:
        longest.append(len(token_ids))
        return fake_decode(token_ids)

    detokenizer = IncrementalDetokenizer(recording_decode)
    ids = [10] * 200
    text = "".join(detokenizer.step(ids[: n + 1]) for n in range(len(ids)))
    assert text == "ok" * 200
    assert max(longest) <= 2
