"""Exceptions shared across proto modules."""


class ConfigError(ValueError):
    """A configuration value is missing, unknown or of the wrong type."""
