"""Sampler names (sd-scripts' `--sample_sampler` values) mapped to diffusers schedulers.

A family gives the base scheduler configuration (betas, prediction type, ...);
the sampler name picks the scheduler class and its own options. Samplers have a
kind: "ddpm" for the noise-prediction families (SD 1.x/2.x, SDXL) and "flow" for
rectified-flow families (Flux), so a DDPM sampler asked of a flow model is an
error rather than noise.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

from library.core.errors import ConfigError


@dataclass(frozen=True)
class SamplerSpec:
    """One sampler: the diffusers scheduler class name and the options it adds to the base config."""

    name: str
    scheduler_class: str
    options: dict[str, Any] = field(default_factory=dict)
    kind: str = "ddpm"


_SAMPLERS: dict[str, SamplerSpec] = {}
_ALIASES: dict[str, str] = {}


def register_sampler(spec: SamplerSpec, aliases: tuple[str, ...] = ()) -> None:
    """Add a sampler (e.g. a family's own) under its name and aliases."""
    _SAMPLERS[spec.name] = spec
    for alias in aliases:
        _ALIASES[alias] = spec.name


for _spec, _aliases in (
    (SamplerSpec("ddim", "DDIMScheduler"), ()),
    (SamplerSpec("ddpm", "DDPMScheduler"), ()),
    (SamplerSpec("pndm", "PNDMScheduler", {"skip_prk_steps": True}), ()),  # as SD ships it
    (SamplerSpec("lms", "LMSDiscreteScheduler"), ("k_lms",)),
    (SamplerSpec("euler", "EulerDiscreteScheduler"), ("k_euler",)),
    (SamplerSpec("euler_a", "EulerAncestralDiscreteScheduler"), ("k_euler_a",)),
    (SamplerSpec("heun", "HeunDiscreteScheduler"), ()),
    (SamplerSpec("dpm_2", "KDPM2DiscreteScheduler"), ("k_dpm_2",)),
    (SamplerSpec("dpm_2_a", "KDPM2AncestralDiscreteScheduler"), ("k_dpm_2_a",)),
    (SamplerSpec("dpmsolver", "DPMSolverMultistepScheduler", 
                 # diffusers allows first-order DPM-Solver only with a last sigma > 0.
                 {"algorithm_type": "dpmsolver", "final_sigmas_type": "sigma_min"}), ()),
    (SamplerSpec("dpmsolver++", "DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++"}), ()),
    (SamplerSpec("dpmsingle", "DPMSolverSinglestepScheduler"), ()),
    # Rectified flow (Flux): Euler steps on the velocity field.
    (SamplerSpec("flow_euler", "FlowMatchEulerDiscreteScheduler", kind="flow"), ("euler_flow",)),
):
    register_sampler(_spec, _aliases)


def sampler_names(kind: Optional[str] = None) -> list[str]:
    """Every accepted name (canonical names and aliases), optionally of one kind, sorted."""
    names = [n for n, s in _SAMPLERS.items() if kind is None or s.kind == kind]
    names += [a for a, n in _ALIASES.items() if kind is None or _SAMPLERS[n].kind == kind]
    return sorted(names)


def canonical_sampler(name: str) -> str:
    """The canonical name of a sampler ("k_euler_a" -> "euler_a"); ConfigError if unknown."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _SAMPLERS:
        raise ConfigError(f"sampler {name!r}: expected one of {', '.join(sampler_names())}")
    return key


def sampler_spec(name: str) -> SamplerSpec:
    return _SAMPLERS[canonical_sampler(name)]


def make_scheduler(name: str, base_config: dict[str, Any], kind: str = "ddpm"):
    """A new diffusers scheduler for sampler `name` on a model whose noise scheme is `kind`.

    `base_config` holds the model's scheduler settings (num_train_timesteps, betas,
    prediction_type, ...); keys a scheduler class does not take are dropped, as
    diffusers' from_config does.
    """
    import diffusers

    spec = sampler_spec(name)
    if spec.kind != kind:
        raise ConfigError(f"sampler {name!r}: not usable with this model ({kind} sampling); expected one of "
                          f"{', '.join(sampler_names(kind))}")
    cls = getattr(diffusers, spec.scheduler_class)
    with warnings.catch_warnings():
        # diffusers marks algorithm_type="dpmsolver" deprecated; it is still sd-scripts' "dpmsolver".
        warnings.simplefilter("ignore", FutureWarning)
        return cls.from_config({**base_config, **spec.options})
