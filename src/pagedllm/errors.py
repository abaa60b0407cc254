"""Errors of the engine's library that callers catch by type."""


class ConfigError(ValueError):
    """A model directory or an engine setting that cannot be served."""
