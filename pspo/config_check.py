"""The one error type of a config mistake, the check that raises it, and the first line of an
exception that a one-line error quotes: imported by config.py and spo_config.py (which config.py
imports), so both report a bad value the same way, and by the components that turn a library's
exception into one line."""
from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A user mistake in a config file or override; the message is one line naming the key."""


def check(ok: bool, key: str, expected: str, value: Any) -> None:
    """Raise ConfigError "key: expected ..., got value" unless ok."""
    if not ok:
        raise ConfigError(f"{key}: expected {expected}, got {value!r}")


def parse_ints(text: str) -> tuple[int, ...]:
    """"6,6,6" -> (6, 6, 6); () if a part is not an integer."""
    try:
        return tuple(int(part) for part in str(text).split(","))
    except ValueError:
        return ()


def first_line(e: BaseException, limit: int = 300) -> str:
    """The first line of e's message, at most `limit` characters; e's type name if it has none."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]
