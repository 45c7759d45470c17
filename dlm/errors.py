"""One exception type for every mistake a user can make.

The CLI turns a `DlmError` into a one-line message on stderr and exit code 2; library callers
catch it like any other exception. Internal bugs stay ordinary exceptions with tracebacks.
"""


class DlmError(Exception):
    """Bad input: a field and what is allowed, in one line."""


def check(cond: bool, message: str) -> None:
    """Raise DlmError(message) unless cond holds."""
    if not cond:
        raise DlmError(message)
