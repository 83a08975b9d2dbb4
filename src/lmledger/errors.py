"""The one exception type that means "the user asked for something we cannot do".

`lmledger.cli.main` turns it into a single line on stderr and exit code 2, with no traceback.
Messages name the problem and the fix, e.g. "data dir data/stdlib has no meta.json: run `lmledger prepare`".
"""


class UserError(Exception):
    """Bad input or an impossible request; the message is shown to the user as one line."""


class ConfigError(UserError, ValueError):
    """An invalid configuration value (also a ValueError, for code that uses the classes directly)."""
