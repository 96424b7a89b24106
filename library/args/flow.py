"""Flow-matching flags (FLUX.1 scripts add them through their family's add_arguments)."""

from __future__ import annotations

import argparse
from typing import Any, Mapping, Union

from library.errors import ConfigError
from library.train.flow import PREDICTION_TYPES, TIMESTEP_SAMPLINGS, WEIGHTING_SCHEMES, FlowOptions


def add_flow_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --timestep_sampling ... --model_prediction_type (sd-scripts names; prediction default differs)."""
    g = parser.add_argument_group("flow matching (FLUX.1)")
    g.add_argument("--timestep_sampling", type=str, default="sigma", choices=list(TIMESTEP_SAMPLINGS),
                   help="how σ is drawn: sigma (by --weighting_scheme, on the shifted schedule), uniform, sigmoid, "
                        "shift (sigmoid then --discrete_flow_shift) or flux_shift (shifted by image size)")
    g.add_argument("--sigmoid_scale", type=float, default=1.0,
                   help="scale of the normal draw inside sigmoid/shift/flux_shift sampling")
    g.add_argument("--discrete_flow_shift", type=float, default=3.0,
                   help="shift of the schedule for --timestep_sampling sigma and shift (> 1: noisier)")
    g.add_argument("--weighting_scheme", type=str, default="uniform", choices=list(WEIGHTING_SCHEMES),
                   help="density of σ for --timestep_sampling sigma; loss weight under sigma_scaled")
    g.add_argument("--logit_mean", type=float, default=0.0, help="mean of the logit_normal weighting scheme")
    g.add_argument("--logit_std", type=float, default=1.0, help="std of the logit_normal weighting scheme")
    g.add_argument("--mode_scale", type=float, default=1.29, help="scale of the mode weighting scheme")
    g.add_argument("--model_prediction_type", type=str, default="raw", choices=list(PREDICTION_TYPES),
                   help="raw (default here: the output is the velocity), additive (output + x_t) or sigma_scaled "
                        "(sd-scripts' default: an x0 estimate compared with the velocity target)")


def flow_options_from_args(ns: Union[argparse.Namespace, Mapping[str, Any]]) -> FlowOptions:
    """FlowOptions from a namespace or dict of flags; refuses flags that have no meaning for flow models."""
    values = ns if isinstance(ns, Mapping) else vars(ns)
    for flag in ("min_timestep", "max_timestep"):
        if values.get(flag) is not None:
            raise ConfigError(f"--{flag}: not supported for flow-matching models (FLUX.1); "
                              "shape the σ distribution with --timestep_sampling instead")
    if values.get("zero_terminal_snr"):
        raise ConfigError("--zero_terminal_snr: only for DDPM models; a flow-matching model already reaches pure noise")
    defaults = FlowOptions()
    opts = FlowOptions(**{name: values.get(name) if values.get(name) is not None else getattr(defaults, name)
                          for name in defaults.__dataclass_fields__})
    opts.check()
    return opts
