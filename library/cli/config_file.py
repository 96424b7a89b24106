"""--config_file (a TOML of flags, sections flattened; the command line wins) and --output_config."""

from __future__ import annotations

import argparse
import difflib
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence

import toml

from library.cli.describe import print_description
from library.cli.options import flag
from library.core.errors import ConfigError
from library.core.io_utils import atomic_write_text

_NOT_SAVED = {"config_file", "output_config", "check_config", "describe_flags"}
_SECRETS = {"wandb_api_key", "huggingface_token"}  # accepted in a config file, never written to one


@dataclass
class ConfigFileFlags:
    flag_group: ClassVar[str] = "config file"
    config_file: Optional[str] = flag(None, "TOML file of flags (any [section] layout; keys are flag names without --)")
    output_config: bool = flag(False, "write the effective flags to --config_file and exit")
    check_config: bool = flag(False, "check every flag, the config file and the dataset config's keys and values as "
                                     "a run would, print 'config ok' and exit 0; a problem is the run's one-line error "
                                     "and exit code 2. Loads no model and reads no image")
    describe_flags: bool = flag(False, "print every flag of this script (name, type, default, choices, help, group, "
                                       "range) and the model family's facts as JSON and exit 0; loads nothing")


def _flatten(data: dict, path: str, out: dict, origin: dict) -> None:
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if isinstance(value, dict):
            _flatten(value, where, out, origin)
        else:
            out[key] = value
            origin[key] = where


def read_config_file(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Flatten the TOML file into {flag_dest: value}; unknown keys are an error naming the key."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config_file {path}: file not found")
    try:
        data = toml.load(path)
    except (toml.TomlDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    flat: dict[str, Any] = {}
    origin: dict[str, str] = {}
    _flatten(data, "", flat, origin)
    known = {a.dest for a in parser._actions} - _NOT_SAVED - {"help"}
    lines = []
    for key in flat:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            lines.append(f"{path}: {origin[key]}: unknown flag{hint}")
    if lines:  # every unknown key at once, one line each (sd-scripts ignores them silently)
        raise ConfigError("\n".join(lines))
    return flat


def parse_with_config_file(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """Parse argv; values from --config_file become defaults, so explicit flags override them."""
    if not hasattr(parser, "original_defaults"):
        parser.original_defaults = {a.dest: a.default for a in parser._actions}
    first, _ = parser.parse_known_args(argv)
    if getattr(first, "describe_flags", False) and hasattr(parser, "flag_specs"):
        print_description(parser)  # before the config file and every check: it describes, it does not run
        raise SystemExit(0)
    if first.config_file and not first.output_config:
        values = read_config_file(first.config_file, parser)
        check_choices(values, parser)
        parser.set_defaults(**values)
    ns = parser.parse_args(argv)
    if ns.output_config:
        if not ns.config_file:
            raise ConfigError("--output_config: needs --config_file PATH to write to")
        write_config_file(ns, ns.config_file, parser)
        raise SystemExit(0)
    return ns


def check_choices(values: dict[str, Any], parser: argparse.ArgumentParser) -> None:
    """A config file's value of a flag with choices must be one of them, as on the command line (argparse checks
    only those): one-line ConfigError naming the flag."""
    actions = {a.dest: a for a in parser._actions}
    for key, value in values.items():
        action = actions[key]
        if action.choices is None:
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and action.type not in (None, str):
                try:
                    item = action.type(item)  # "225" for an int flag: argparse converts it too
                except (TypeError, ValueError, argparse.ArgumentTypeError):
                    pass
            if item not in action.choices:
                raise ConfigError(f"--{key}: expected one of {', '.join(map(str, action.choices))}, got {item!r}")


def config_values(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The flags of a namespace that differ from the parser defaults (None values dropped)."""
    out = {}
    defaults = getattr(parser, "original_defaults", {})
    for action in parser._actions:
        dest = action.dest
        if dest in _NOT_SAVED or dest in _SECRETS or dest == "help" or not hasattr(ns, dest):
            continue
        value = getattr(ns, dest)
        if value is None or value == defaults.get(dest, action.default):
            continue
        out[dest] = value
    return out


def flag_values(ns: argparse.Namespace) -> dict[str, Any]:
    """Every flag of a namespace with its value, secrets and the config-file flags left out (a state records them)."""
    return {name: value for name, value in vars(ns).items() if name not in _NOT_SAVED and name not in _SECRETS}


def write_config_file(ns: argparse.Namespace, path: str, parser: argparse.ArgumentParser) -> None:
    atomic_write_text(path, toml.dumps(config_values(ns, parser)))
