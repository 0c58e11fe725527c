"""The one exception family for user mistakes.

Every ``CfpError`` is a single line that says what is wrong and what to do; the CLI prints it
and exits with status 2. Anything else escaping the CLI is a bug in cfp.
"""


class CfpError(Exception):
    """A user-facing error: bad input, a missing or foreign file, an impossible request."""
