"""Flow-matching flags: declared by library.objectives.flow.FlowOptions, added for the families that train with
rectified flow (FLUX.1) through their options dataclass; this module keeps the stand-alone forms."""

from __future__ import annotations

import argparse
from typing import Any, Mapping, Union

from library.cli.options import add_option_arguments, options_from_values
from library.objectives.flow import FlowOptions, check_flow_compatible


def add_flow_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --timestep_sampling ... --model_prediction_type (sd-scripts names; prediction default differs)."""
    add_option_arguments(parser.add_argument_group("flow matching"), FlowOptions)


def flow_options_from_args(ns: Union[argparse.Namespace, Mapping[str, Any]]) -> FlowOptions:
    """FlowOptions from a namespace or dict of flags; refuses flags that have no meaning for flow models."""
    values = ns if isinstance(ns, Mapping) else vars(ns)
    check_flow_compatible(values.get("min_timestep"), values.get("max_timestep"), bool(values.get("zero_terminal_snr")))
    return options_from_values(FlowOptions, values)
