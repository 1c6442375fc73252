"""Small text helpers every alert message uses: durations, UTC times, one-line and clipped text (pure)."""

from __future__ import annotations

from datetime import UTC, datetime


def human_duration(seconds: float) -> str:
    """3600 -> '1 h', 5400 -> '1.5 h', 900 -> '15 min', 45 -> '45 s'."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}".removesuffix(".0") + f" {unit}"
    return f"{seconds:g} s"


def utc(ts: float) -> str:
    """Epoch seconds as UTC ISO 8601: '2023-11-14T22:13:20Z'."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def clip(text: str, limit: int) -> str:
    """`text`, cut to `limit` characters with '…'."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def one_line(text: str) -> str:
    return " ".join(text.split())


def times(n: int, noun: str) -> str:
    """'1 restart', '3 restarts'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
