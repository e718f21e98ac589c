"""Errors that the CLI reports as one line, with exit code 2, instead of a traceback."""

import signal


class UserError(Exception):
    """A mistake in the user's input: a bad option, config key or data file."""


class DataUnavailable(UserError):
    """A data set cannot be had here (offline, not downloaded); the demo falls back to synthetic data."""


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM, so that runs and checkpoints close as on Ctrl-C."""


def raise_on_sigterm() -> None:
    def handler(signum, frame):
        raise Terminated(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)
