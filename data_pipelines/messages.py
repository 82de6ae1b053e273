"""One-line user messages from exceptions: every user error reaches the terminal as one line
(`vlp: error: ...`, vlp/cli.py), and a library error's text can span many, or be huge (a 10 MB
model name in a config): `cap` bounds every line at MAX_LINE characters."""

from __future__ import annotations

MAX_LINE = 500
"""Characters an error line may hold; the middle of a longer one is elided."""


def cap(text: str, limit: int = MAX_LINE) -> str:
    """`text` if at most `limit` characters, else its head and tail around ' ... (N chars) ... '
    (both ends: the start names what failed, the end often says why)."""
    if len(text) <= limit:
        return text
    mark = f" ... ({len(text)} chars) ... "
    keep = max(0, limit - len(mark))
    head = (keep * 2) // 3
    return text[:head] + mark + text[len(text) - (keep - head):]


def first_line(error: BaseException) -> str:
    """'ErrorType: first line of its message' (the type alone for an empty message), capped."""
    text = str(error).strip()
    return cap(f"{type(error).__name__}: {text.splitlines()[0]}") if text else type(error).__name__
