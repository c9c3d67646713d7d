"""Token counts estimated from characters, where no tokenizer is at hand (gateway admission,
session history budgeting). The worker's engine reports the real counts afterwards."""

import math

CHARS_PER_TOKEN = 4
# What a chat template adds around each message (role markers, separators).
TOKENS_PER_MESSAGE = 4


def estimate_tokens(*, chars: int, messages: int = 0) -> int:
    return math.ceil(chars / CHARS_PER_TOKEN) + messages * TOKENS_PER_MESSAGE
