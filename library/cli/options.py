"""Flags from declared option dataclasses: a family (or any component) declares its options once, with help text
in each field's metadata, and this module turns them into argparse flags and back into a typed, checked object.

    @dataclass
    class FluxOptions:
        guidance_scale: float = field(default=3.5, metadata={"help": "..."})
        flow: FlowOptions = field(default_factory=FlowOptions)   # nested: its fields are flags too

Field name = flag name. bool fields become store_true flags; Optional[T] fields take a T; a "choices" entry in
the metadata limits the values. After building, every dataclass in the tree that has a `check()` method is
checked (a one-line ConfigError naming the flag).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Iterator, Mapping, Optional


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _scalar(tp: Any) -> Any:
    """int for Optional[int], float for float, ..."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) is typing.Union and len(args) == 1 else tp


def iter_option_fields(cls: type) -> Iterator[tuple[dataclasses.Field, Any]]:
    """(field, type) of every flag of `cls`, nested option dataclasses flattened, in declaration order."""
    types = _field_types(cls)
    for f in dataclasses.fields(cls):
        tp = _scalar(types[f.name])
        if dataclasses.is_dataclass(tp):
            yield from iter_option_fields(tp)
        else:
            yield f, tp


def flag_names(cls: type) -> tuple[str, ...]:
    """Every flag `cls` declares (nested dataclasses included)."""
    return tuple(f.name for f, _ in iter_option_fields(cls))


def add_option_arguments(group: Any, cls: type, only: Optional[tuple[str, ...]] = None) -> None:
    """Add one flag per field of `cls` (or of the fields named in `only`) to an argparse parser or group."""
    for f, tp in iter_option_fields(cls):
        if only is not None and f.name not in only:
            continue
        help_text = f.metadata.get("help", "")
        if tp is bool:
            group.add_argument(f"--{f.name}", action="store_true", help=help_text)
            continue
        kwargs: dict[str, Any] = {"type": tp, "default": None, "help": help_text}
        if "choices" in f.metadata:
            kwargs["choices"] = list(f.metadata["choices"])
        group.add_argument(f"--{f.name}", **kwargs)


def options_from_values(cls: type, values: Mapping[str, Any]) -> Any:
    """An instance of `cls` from flag values (None or absent: the field's default), checked."""
    types = _field_types(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = _scalar(types[f.name])
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = options_from_values(tp, values)
        elif values.get(f.name) is not None:
            kwargs[f.name] = bool(values[f.name]) if tp is bool else values[f.name]
    options = cls(**kwargs)
    check = getattr(options, "check", None)
    if callable(check):
        check()
    return options


def options_from_namespace(cls: type, ns: argparse.Namespace) -> Any:
    """options_from_values over a parsed namespace."""
    return options_from_values(cls, vars(ns))

