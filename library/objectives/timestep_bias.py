"""Timestep bias (the MaxDiffusion / SimpleTuner / diffusers `--timestep_bias_*` options).

A bias multiplies the density of the training timesteps by a step function of the timestep
in its 0..1000 unit: `multiplier` inside the biased region, 1 outside, then renormalises.

    earlier: region t <  n                       n = int(portion * num_train_timesteps)
    later:   region t >= num_train_timesteps - n
    range:   region begin <= t < end

For DDPM (integer timesteps, uniform on [min_timestep, max_timestep)) the biased law is a
discrete distribution over those integers, P(t) ∝ w(t), drawn by inverse CDF from one
float64 uniform per sample. For flow matching (σ·1000, any density the scheme samples) it
is drawn by acceptance-rejection: propose from the scheme's own sampler, accept with
probability w(t) / max(w). Both draw only from the generator passed in, so a resumed run
replays them; with no active bias nothing here is called and the sampler draws what it
always drew.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from library.core.errors import ConfigError

BIAS_STRATEGIES = ("none", "earlier", "later", "range")


@dataclass(frozen=True)
class TimestepBias:
    """--timestep_bias_strategy / _multiplier / _begin / _end / _portion."""
    strategy: str = "none"
    multiplier: float = 1.0
    begin: Optional[int] = None
    end: Optional[int] = None
    portion: float = 0.25

    @property
    def active(self) -> bool:
        """False for `none` and for a multiplier of exactly 1 (the weights would all be 1)."""
        return self.strategy != "none" and self.multiplier != 1.0

    def check(self, num_train_timesteps: int = 1000) -> None:
        """One-line ConfigError naming the flag for a value the bias cannot use."""
        n = num_train_timesteps
        if self.strategy not in BIAS_STRATEGIES:
            raise ConfigError(f"--timestep_bias_strategy: expected one of {', '.join(BIAS_STRATEGIES)}, "
                              f"got {self.strategy!r}")
        if not self.multiplier > 0:
            raise ConfigError(f"--timestep_bias_multiplier: expected a number > 0 (1 = no bias), got {self.multiplier}")
        if not 0 < self.portion <= 1:
            raise ConfigError(f"--timestep_bias_portion: expected a number in (0, 1], got {self.portion}")
        if self.strategy in ("earlier", "later") and int(self.portion * n) < 1:
            raise ConfigError(f"--timestep_bias_portion: {self.portion} of {n} timesteps is less than one timestep")
        if self.strategy == "range":
            if self.begin is None or self.end is None:
                raise ConfigError("--timestep_bias_strategy range: needs --timestep_bias_begin and --timestep_bias_end")
            if not 0 <= self.begin < self.end <= n:
                raise ConfigError(f"--timestep_bias_begin/--timestep_bias_end: expected 0 <= begin < end <= {n}, "
                                  f"got {self.begin} and {self.end}")
        elif self.begin is not None or self.end is not None:
            raise ConfigError("--timestep_bias_begin/--timestep_bias_end: only used with --timestep_bias_strategy range")

    def region(self, num_train_timesteps: int = 1000) -> tuple[float, float]:
        """The biased region [lo, hi) in timestep units (±inf at an open end)."""
        n = int(self.portion * num_train_timesteps)
        if self.strategy == "earlier":
            return float("-inf"), float(n)
        if self.strategy == "later":
            return float(num_train_timesteps - n), float("inf")
        if self.strategy == "range":
            return float(self.begin), float(self.end)
        return 0.0, 0.0

    def weights(self, timesteps: torch.Tensor, num_train_timesteps: int = 1000) -> torch.Tensor:
        """w(t) float64: `multiplier` inside the region, 1 outside."""
        lo, hi = self.region(num_train_timesteps)
        t = timesteps.double()
        inside = (t >= lo) & (t < hi)
        return torch.where(inside, torch.tensor(float(self.multiplier), dtype=torch.float64),
                           torch.tensor(1.0, dtype=torch.float64))


def _uniform64(n: int, generator: Optional[torch.Generator]) -> torch.Tensor:
    if generator is None:
        return torch.rand((n,), dtype=torch.float64)
    return torch.rand((n,), generator=generator, device=generator.device, dtype=torch.float64).cpu()


def biased_integer_timesteps(bias: TimestepBias, batch_size: int, lo: int, hi: int, num_train_timesteps: int,
                             generator: Optional[torch.Generator]) -> torch.Tensor:
    """Integers in [lo, hi) with P(t) = w(t) / Σ w, by inverse CDF (one float64 uniform per sample), CPU long (B,)."""
    candidates = torch.arange(lo, hi, dtype=torch.long)
    cdf = torch.cumsum(bias.weights(candidates, num_train_timesteps), 0)
    cdf = cdf / cdf[-1]
    u = _uniform64(batch_size, generator)
    index = torch.searchsorted(cdf, u, right=True).clamp_(max=len(candidates) - 1)
    return candidates[index]


def biased_continuous_timesteps(bias: TimestepBias, batch_size: int, propose: Callable[[int], torch.Tensor],
                                num_train_timesteps: int, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Timesteps with density ∝ p(t)·w(t), where `propose(k)` draws k timesteps (CPU, float) from p.

    Acceptance-rejection: each round proposes `batch_size` timesteps and one float64 uniform each,
    keeps those with u < w(t) / max(w), until `batch_size` are kept (in proposal order).
    """
    w_max = max(float(bias.multiplier), 1.0)
    kept: list[torch.Tensor] = []
    have = 0
    while have < batch_size:
        proposal = propose(batch_size).cpu()
        u = _uniform64(batch_size, generator)
        accepted = proposal[u < bias.weights(proposal, num_train_timesteps) / w_max]
        kept.append(accepted)
        have += accepted.shape[0]
    return torch.cat(kept)[:batch_size]
