"""Errors meant for the user: one line naming the input and what was expected."""

import logging
from typing import Any, Callable


class UserError(Exception):
    """Bad input (a path, image, caption, TOML key, flag). Entry scripts print it and exit 2."""


class DataError(UserError):
    """The dataset cannot be used as given; the message may list several problems, one per line."""


class ConfigError(UserError):
    """A flag, a --config_file key or a dataset TOML key is wrong."""


def run_tool(body: Callable[..., Any], *args: Any) -> int:
    """The command-line convention: run `body(*args)`; a UserError becomes one line "error: ..." on
    stderr and exit code 2, anything else returned is success (0)."""
    import sys

    try:
        body(*args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


_warned: set[str] = set()


def warn_once(logger: logging.Logger, message: str) -> None:
    """Log `message` as a warning the first time it is seen in this process."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def forget_warnings() -> None:
    """Let every `warn_once` message be logged again (as in a new process)."""
    _warned.clear()
