"""Errors that the CLI reports as one line, with exit code 2, instead of a traceback."""


class UserError(Exception):
    """A mistake in the user's input: a bad option, config key or data file."""


class DataUnavailable(UserError):
    """A data set cannot be had here (offline, not downloaded); the demo falls back to synthetic data."""


def one_line(error: BaseException, limit: int = 120) -> str:
    """A library's reason, to quote in a one-line `UserError`: its first line, cut (its type when empty)."""
    lines = str(error).strip().splitlines()
    line = lines[0].strip() if lines else type(error).__name__
    return line if len(line) <= limit else f"{line[:limit - 3]}..."
