"""How the advice writes its figures: money, durations, ranges and speed-ups, without exponents."""

from __future__ import annotations

import math

from common.advisor.estimate import Range


def figure(value: float) -> str:
    """Two significant digits, without an exponent for large values (150, not 1.5e+02)."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.2g}"


def money(value: float) -> str:
    if math.isnan(value):
        return "price unknown"
    if math.isinf(value):
        return "never finishes"
    return f"${value:.3g}" if value < 100 else f"${value:,.0f}"


def duration(seconds: float) -> str:
    if math.isnan(seconds):
        return "?"
    if math.isinf(seconds):
        return "never"
    for unit, size in (("h", 3600), ("min", 60), ("s", 1)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds * 1000:.3g} ms"


def span(value: Range | None, show) -> str:
    """Expected (low-high), each bound shown by `show`; "-" where there is no figure."""
    if value is None:
        return "-"
    return f"{show(value.expected)} ({show(value.low)}-{show(value.high)})"


def speedup(value: Range) -> str:
    return f"{figure(value.low)}-{figure(value.high)}x (expected {figure(value.expected)}x)"


def milliseconds(seconds: float) -> str:
    return f"{figure(1000 * seconds)} ms"


def json_safe(value):
    """Infinity (a spot run that never finishes, data read from memory) and NaN (unknown) as null: JSON has
    neither."""
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value
