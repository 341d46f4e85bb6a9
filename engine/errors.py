"""One exception type for every problem a user can cause or fix.

The CLI, the server and the app print ``str(err)`` as a single line, never a traceback, so the
message must name the problem (which file, which field, what was expected).
"""


class TandemError(Exception):
    """A user-facing error: bad input, a refused checkpoint, a missing model."""
