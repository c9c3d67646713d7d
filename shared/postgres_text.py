"""Text as PostgreSQL can store it: its `text` and `jsonb` types cannot hold U+0000.

Every row that goes to PostgreSQL through the outbox passes its text through `postgres_text`:
the session manager's rows (`services/sessions/outbox.py`) and the usage rows of both the session
manager and the worker (`shared/usage.py`).
"""

from typing import overload


@overload
def postgres_text(value: str) -> str: ...
@overload
def postgres_text(value: None) -> None: ...
def postgres_text(value: str | None) -> str | None:
    """`value` as PostgreSQL can store it: its text type cannot hold U+0000, which becomes U+FFFD.

    One row PostgreSQL refuses would stop its whole batch, and so every later row, from persisting.
    """
    if value is None or "\x00" not in value:
        return value
    return value.replace("\x00", "\ufffd")
