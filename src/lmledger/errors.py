"""The one exception type that means "the user asked for something we cannot do".

`lmledger.cli.main` turns it into one line on stderr and exit code 2, with no traceback.
Messages name the problem and the fix.
E.g. "data dir data/stdlib has no meta.json: run `lmledger prepare`".
"""

__all__ = ["ConfigError", "UserError"]


class UserError(Exception):
    """Bad input or an impossible request. The user sees the message as one line."""


class ConfigError(UserError, ValueError):
    """An invalid configuration value (also a ValueError, for code that uses the classes directly)."""
