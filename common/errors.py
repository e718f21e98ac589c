"""Errors that the CLI reports as one line, with exit code 2, instead of a traceback."""


class UserError(Exception):
    """A mistake in the user's input: a bad option, config key or data file."""


class DataUnavailable(UserError):
    """A data set cannot be had here (offline, not downloaded); the demo falls back to synthetic data."""

