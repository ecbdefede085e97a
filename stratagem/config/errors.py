"""The config exceptions and warning: :class:`ConfigError`, :class:`ConfigWarning`,
:class:`ConfigAttributeError`, :class:`ConfigKeyError` and :class:`ConfigErrors` (several
errors of one config in one)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config file that cannot be read, or a bad override; the message names the file/key."""


class ConfigErrors(ConfigError):
    """Several errors of one config, reported together: the message lists them all, and
    ``errors`` holds each exception (for a caller that reports them one by one)."""

    def __init__(self, message: str, errors: list[Exception]) -> None:
        super().__init__(message)
        self.errors = list(errors)


class ConfigWarning(UserWarning):
    """A config value was accepted after a fix (a number given as a string); the message says
    which key and how to write it."""


class ConfigAttributeError(AttributeError):
    """A missing config key read as an attribute (``cfg.modle``); the message names it."""


class ConfigKeyError(KeyError):
    """A missing config key; a KeyError whose message reads without extra quotes."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ''
