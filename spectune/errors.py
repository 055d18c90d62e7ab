"""The one error type a user sees: a clear, one-line message and exit code 2."""


class SpectuneError(Exception):
    """Bad input or an unusable environment. The message names the file/field and the fix."""

    exit_code = 2
