"""Errors meant for the user: one line naming the input and what was expected."""


class UserError(Exception):
    """Bad input (a path, image, caption, TOML key, flag). Entry scripts print it and exit 2."""


class DataError(UserError):
    """The dataset cannot be used as given; the message may list several problems, one per line."""


class ConfigError(UserError):
    """A flag, a --config_file key or a dataset TOML key is wrong."""
