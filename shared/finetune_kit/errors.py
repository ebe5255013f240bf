"""Errors raised for bad input, before any long work starts.

Each message names the bad value, the rule it broke, and the fix. Recipes catch
``UserInputError`` at the top of ``main`` and exit with the message alone (no traceback),
because the traceback of a configuration mistake helps nobody.
"""


class UserInputError(ValueError):
    """Something the user passed (a path, a flag, a config value) cannot work."""


class DataError(UserInputError):
    """The training data is missing, malformed, or empty after filtering."""


class ConfigError(UserInputError):
    """A model, DeepSpeed or launch setting contradicts another or the hardware."""
