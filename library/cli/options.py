"""Flags as data: every flag is one dataclass field, declared once, with its type, default, choices, help, group and
range; argparse, `--config_file` keys, the docs' flag tables and `--describe_flags` are all made from it.

    @dataclass
    class NetworkFlags:
        flag_group: ClassVar[str] = "network"                      # the --help / docs section of every field
        network_dim: int = flag(4, "LoRA rank (default 4, as sd-scripts)", range=at_least(1))
        flow: FlowOptions = field(default_factory=FlowOptions)      # nested: its fields are flags too

Field name = flag name. Types: bool with default False is a switch (--flag); bool with default True takes
true|false; Optional[T] takes a T; Optional[list[T]] takes any number of T (nargs "*"). Metadata: "help",
"choices", "range" (a Range), "aliases" (more option strings for the same flag), "metavar",
"parse" (the function argparse converts the text with, where it is not the type itself).

The core option groups (library/cli/*.py) hold their defaults in argparse, so --help, the docs and a written
config show them. A family's options dataclass (library/families) is added with argparse default None: an unset
flag takes the dataclass default when `options_from_values` builds the checked object.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

MAX_LEARNING_RATE = 10.0  # no optimizer here trains above it; DAdaptation / Prodigy use 1.0
MAX_SEED = 2**32 - 1  # NumPy's seed range


@dataclass(frozen=True)
class Range:
    """The values a numeric flag can take (library/cli/ranges.py checks them before anything loads)."""
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False  # lo itself is outside
    hi_open: bool = False
    integer: bool = False
    note: str = ""

    def contains(self, value: float) -> bool:
        if self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
            return False
        return not (self.hi is not None and (value > self.hi or (self.hi_open and value == self.hi)))

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        g = lambda v: f"{v:g}" if not self.integer else str(int(v))  # noqa: E731
        if self.lo is not None and self.hi is not None:
            left, right = ("(" if self.lo_open else "["), (")" if self.hi_open else "]")
            text = f"{kind} in {left}{g(self.lo)}, {g(self.hi)}{right}"
        elif self.lo is not None:
            text = f"{kind} {'>' if self.lo_open else '>='} {g(self.lo)}"
        elif self.hi is not None:
            text = f"{kind} {'<' if self.hi_open else '<='} {g(self.hi)}"
        else:
            text = f"a finite {'integer' if self.integer else 'number'}"
        return f"{text} ({self.note})" if self.note else text


def at_least(n: int, note: str = "") -> Range:
    """An integer >= n."""
    return Range(lo=n, integer=True, note=note)


LEARNING_RATE = Range(0, MAX_LEARNING_RATE, note=f"learning rates above {MAX_LEARNING_RATE:g} do not train; "
                                                 "DAdaptation/Prodigy use 1.0")
RATE = Range(0, 1)
SEED = Range(0, MAX_SEED, integer=True)


def flag(default: Any = None, help: str = "", *, choices: Optional[Iterable] = None, range: Optional[Range] = None,
         aliases: tuple[str, ...] = (), metavar: Optional[str] = None, parse: Optional[Callable] = None) -> Any:
    """One flag's declaration, as a dataclass field (see the module docstring)."""
    metadata: dict[str, Any] = {"help": help}
    for key, value in (("choices", tuple(choices) if choices is not None else None), ("range", range),
                       ("aliases", tuple(aliases)), ("metavar", metavar), ("parse", parse)):
        if value:
            metadata[key] = value
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class FlagSpec:
    """What a flag is, as argparse, the config file, the docs and --describe_flags see it."""
    name: str
    type: Any  # bool, int, float, str
    default: Any  # what a run uses when the flag is not given
    help: str
    group: str
    choices: Optional[tuple] = None
    range: Optional[Range] = None
    aliases: tuple[str, ...] = ()
    metavar: Optional[str] = None
    parse: Optional[Callable] = None
    many: bool = False  # takes any number of values (a list)
    parser_default: Any = None  # the namespace value when the flag is not given

    @property
    def switch(self) -> bool:
        """A store_true flag: --name turns it on, it takes no value."""
        return self.type is bool and not self.default


def _scalar(tp: Any) -> Any:
    """int for Optional[int], float for float, ..."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) is typing.Union and len(args) == 1 else tp


def iter_option_fields(cls: type) -> Iterator[tuple[dataclasses.Field, Any]]:
    """(field, type) of every flag of `cls`, nested option dataclasses flattened, in declaration order."""
    types = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = _scalar(types[f.name])
        if dataclasses.is_dataclass(tp):
            yield from iter_option_fields(tp)
        else:
            yield f, tp


def flag_names(cls: type) -> tuple[str, ...]:
    """Every flag `cls` declares (nested dataclasses included)."""
    return tuple(f.name for f, _ in iter_option_fields(cls))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def flag_specs(cls: type, group: Optional[str] = None, declared_defaults: bool = True,
               only: Optional[tuple[str, ...]] = None) -> list[FlagSpec]:
    """The flags `cls` declares. `group`: the section (default: the class's `flag_group`).
    `declared_defaults`: argparse holds the declared default (core groups); else None (a family's options)."""
    title = group or getattr(cls, "flag_group", cls.__name__)
    out = []
    for f, tp in iter_option_fields(cls):
        if only is not None and f.name not in only:
            continue
        many = typing.get_origin(tp) is list
        base = typing.get_args(tp)[0] if many else tp
        default = _default(f)
        out.append(FlagSpec(name=f.name, type=base, default=default, help=f.metadata.get("help", ""), group=title,
                            choices=f.metadata.get("choices"), range=f.metadata.get("range"),
                            aliases=f.metadata.get("aliases", ()), metavar=f.metadata.get("metavar"),
                            parse=f.metadata.get("parse"), many=many,
                            parser_default=default if declared_defaults or base is bool else None))
    return out


def parse_bool(value: str) -> bool:
    """true/false, 1/0, yes/no, on/off (a bool flag whose default is true takes a value)."""
    v = str(value).strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def add_flag(group: Any, spec: FlagSpec) -> None:
    """One argparse argument for `spec` on a parser or argument group."""
    names = [f"--{spec.name}", *(f"--{a}" for a in spec.aliases)]
    help_text = spec.help.replace("%", "%%")  # argparse formats help with %
    if spec.switch:
        group.add_argument(*names, dest=spec.name, action="store_true", help=help_text)
        return
    kwargs: dict[str, Any] = {"dest": spec.name, "type": spec.parse or (parse_bool if spec.type is bool else spec.type),
                              "default": spec.parser_default, "help": help_text}
    if spec.choices is not None:
        kwargs["choices"] = list(spec.choices)
    if spec.many:
        kwargs["nargs"] = "*"
    if spec.metavar or spec.type is bool:
        kwargs["metavar"] = spec.metavar or "true|false"
    group.add_argument(*names, **kwargs)


def add_flags(parser: argparse.ArgumentParser, specs: Iterable[FlagSpec]) -> None:
    """Add `specs` to `parser`, one argument group per section, in the order the sections first appear."""
    groups: dict[str, Any] = {}
    for spec in specs:
        if spec.group not in groups:
            groups[spec.group] = parser.add_argument_group(spec.group)
        add_flag(groups[spec.group], spec)


def add_option_arguments(group: Any, cls: type, only: Optional[tuple[str, ...]] = None) -> None:
    """Add one flag per field of a family's options dataclass `cls` (or of the fields named in `only`) to an
    argparse parser or group; an unset flag is None, and `options_from_values` fills in the declared default."""
    for spec in flag_specs(cls, group="", declared_defaults=False, only=only):
        add_flag(group, spec)


def options_from_values(cls: type, values: Mapping[str, Any]) -> Any:
    """An instance of `cls` from flag values (None or absent: the field's default), checked."""
    types = typing.get_type_hints(cls)
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


def settings_from(target: type, ns: argparse.Namespace, **given: Any) -> Any:
    """A `target` settings dataclass from `given` and, for its other fields, the flag of the same name in `ns`
    (a flag a setting takes as it is; a field that is not a flag of `ns` keeps its dataclass default)."""
    taken = {f.name: getattr(ns, f.name) for f in dataclasses.fields(target)
             if f.name not in given and hasattr(ns, f.name)}
    return target(**taken, **given)


def flag_values(ns: argparse.Namespace, cls: type) -> dict[str, Any]:
    """{flag: value} of every flag `cls` declares (its declared default where `ns` lacks it)."""
    return {spec.name: getattr(ns, spec.name, spec.default) for spec in flag_specs(cls)}
