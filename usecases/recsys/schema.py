"""One set of rules for what `/invocations` (and the pyfunc) and `/events` take in, checked as JSON gives them and
never coerced; a `BadField` is one line naming the field. Standard library only."""

from __future__ import annotations

import functools
import math
import numbers
import reprlib
import time
from datetime import datetime, timezone

MAX_K = 1000
EARLIEST_TIMESTAMP = 788_918_400  # 1995-01-01 00:00 UTC
FUTURE_SLACK_S = 86_400  # a client's clock may run this far ahead of the server's
FINER_UNITS = (("milliseconds", 10**3), ("microseconds", 10**6), ("nanoseconds", 10**9))
WINDOW = "whole seconds since the epoch, from 1995-01-01 to a day after now"


class BadField(ValueError):
    """A value that breaks a rule, said in one line naming the field."""


def refused_as(error: type[Exception]):
    """A parser's `BadField` as `error`, with the same line."""
    def decorate(parse):
        @functools.wraps(parse)
        def parsed(*args, **kwargs):
            try:
                return parse(*args, **kwargs)
            except BadField as refused:
                raise error(str(refused)) from None
        return parsed
    return decorate


def missing(value) -> bool:
    """JSON's null, or pandas's NaN in its place."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def checked_id(value, field: str) -> str | int:
    """A user or item id as given (a numpy integer as a plain int)."""
    if missing(value):
        raise BadField(f"{field} is missing")
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, str) and value:
        return value
    raise BadField(f"{field} must be a non-empty string or an integer, got {shown(value)}")


def checked_k(value, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= MAX_K:
        raise BadField(f"{field} must be an integer from 1 to {MAX_K}, got {shown(value)}")
    return int(value)


def checked_timestamp(value, field: str, now: float | None = None) -> int:
    """Whole seconds since the epoch within the window (its end: a day after `now`, default the clock's)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise BadField(f"{field} must be {WINDOW} (an integer), got {shown(value)}")
    value, latest = int(value), int(time.time() if now is None else now) + FUTURE_SLACK_S
    if EARLIEST_TIMESTAMP <= value <= latest:
        return value
    for unit, per_second in FINER_UNITS:
        if EARLIEST_TIMESTAMP <= value // per_second <= latest:
            raise BadField(f"{field} {value} looks like {unit} since the epoch: send whole seconds "
                           f"({value // per_second})")
    where = (f"before 1995-01-01 ({EARLIEST_TIMESTAMP})" if value < EARLIEST_TIMESTAMP
             else f"more than a day ahead of this server's clock (latest accepted {latest}, "
             f"{datetime.fromtimestamp(latest, timezone.utc):%Y-%m-%d %H:%M UTC})")
    raise BadField(f"{field} {value} is {where}: a timestamp is {WINDOW}")


def shown(value) -> str:
    """A value as a refusal quotes it: its type and a short repr, on one line (`repr` escapes line breaks)."""
    plain = value.tolist() if hasattr(value, "tolist") and not isinstance(value, (str, bytes)) else value
    return f"{type(value).__name__} {reprlib.repr(plain)}"
