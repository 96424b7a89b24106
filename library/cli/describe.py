"""--describe_flags: every flag of a training script and its model family's facts, as JSON (the web UI reads it
instead of scraping --help and draws its form from it). Nothing is loaded: the flags are declarations."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional, Sequence

from library.cli.options import FlagSpec

SCHEMA = 1
FLAG_KEYS = ("name", "type", "default", "choices", "help", "group", "range", "aliases", "takes_value", "many")
_TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "str"}


def _jsonable(value: Any) -> Any:
    """Tuples as lists, dataclasses as dicts, classes and other objects by name: what json.dumps can write."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return getattr(value, "__name__", None) or str(value)


def flag_description(spec: FlagSpec) -> dict[str, Any]:
    """One flag: its name, type ("bool", "int", "float", "str"; `many`: a list of them), the default a run uses
    without it, choices, help, group, range (or None), other names, and whether it takes a value (a switch does not)."""
    rng = None
    if spec.range is not None:
        rng = {**_jsonable(spec.range), "text": spec.range.describe()}
    return {"name": spec.name, "type": _TYPE_NAMES.get(spec.type, getattr(spec.type, "__name__", str(spec.type))),
            "default": _jsonable(spec.default), "choices": _jsonable(spec.choices), "help": spec.help,
            "group": spec.group, "range": rng, "aliases": list(spec.aliases), "takes_value": not spec.switch,
            "many": spec.many}


def family_facts(family: Any) -> dict[str, Any]:
    """The family's declared facts (its `facts()` where the class has one), always with its name."""
    if family is None:
        return {}
    facts = getattr(family, "facts", None)
    out = _jsonable(facts()) if callable(facts) else {}
    return {"name": family.name, **out}


def describe(specs: Sequence[FlagSpec], family: Any = None, script: Optional[str] = None,
             fine_tune: bool = False, mode: Optional[str] = None) -> dict[str, Any]:
    """The JSON document --describe_flags prints (`mode`: "lora", "fine_tune" or "textual_inversion"; default from
    `fine_tune`)."""
    groups = list(dict.fromkeys(spec.group for spec in specs))
    return {"schema": SCHEMA, "script": script, "mode": mode or ("fine_tune" if fine_tune else "lora"),
            "family": family_facts(family), "groups": groups, "flags": [flag_description(s) for s in specs]}


def print_description(parser: Any) -> None:
    """Print the description of a training parser (library/cli/parser.py build_parser) on stdout."""
    doc = describe(parser.flag_specs, getattr(parser, "family", None), parser.prog, getattr(parser, "fine_tune", False),
                   getattr(parser, "mode", None))
    print(json.dumps(doc, indent=1))


def describe_families() -> dict[str, Any]:
    """Every registered family's facts (the web UI learns the families, their scripts and labels from it)."""
    from library.families import registered_families

    return {"schema": SCHEMA, "families": [family_facts(family) for family in registered_families()]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m library.cli.describe --describe_families`: every registered family's facts as JSON."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m library.cli.describe", description=main.__doc__)
    parser.add_argument("--describe_families", action="store_true", required=True,
                        help="print every registered family's facts (scripts, model types, labels, ...) as JSON")
    parser.parse_args(argv)
    print(json.dumps(describe_families(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
