"""The one exception family the command line turns into a one-line message and exit status 2."""

from __future__ import annotations


class InputError(ValueError):
    """Bad input from the user: the message names the bad value and what would be accepted."""
