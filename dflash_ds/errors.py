"""The one exception type users see: a clear, single-line message and a non-zero exit."""


class DFlashError(Exception):
    """A user-facing error (bad input, bad config, bad layout). The CLI prints it as one line."""

    exit_code = 2
