"""One-line user messages from exceptions: every user error reaches the terminal as one line
(`vlp: error: ...`, vlp/cli.py), and a library error's text can span many."""

from __future__ import annotations


def first_line(error: BaseException) -> str:
    """'ErrorType: first line of its message' (the type alone for an empty message)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
