"""Extract a LoRA from two models: a rank-r SVD of tuned − org per layer (sd-scripts' extract_lora_from_models).

Per layer: D = W_tuned − W_org flattened to [out, in·k²]; its top-r SVD gives
up = U_r·diag(S_r), down = V_rᵀ, alpha = r (scale 1). Both factors are clamped to
±(the `clamp_quantile` of their joined absolute values) against outliers. sd-scripts
takes the quantile of the signed values; as the sign of each singular pair is
arbitrary (it differs between SVD implementations), its clamp can cut one pair hard
and leave its negation alone. The absolute values make the result sign-invariant.
The text encoder is included only when some layer differs by more than
`min_diff`. For r ≪ min(out, in) a randomized SVD replaces the dense one; on the
spectra of fine-tuning differences its error is within 1% of the optimum (see
bench/bench_lora_tools.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch

from library.core.errors import ConfigError, UserError
from networks import lora_svd
from networks.lora_files import LoraModule
from networks.lora_targets import LoraLayer

SVD_METHODS = ("auto", "full", "randomized")
# Randomized SVD pays off only when the rank is a small part of the matrix.
RANDOMIZED_MAX_FRACTION = 0.25


@dataclass
class ExtractOptions:
    """--dim, --conv_dim, --clamp_quantile, --min_diff, --device, and which SVD to use."""

    dim: int = 4
    conv_dim: Optional[int] = None
    clamp_quantile: float = 0.99
    min_diff: float = 0.01
    device: str = "cpu"
    svd: str = "auto"

    def check(self) -> None:
        if self.dim < 1:
            raise ConfigError(f"--dim: expected an integer >= 1, got {self.dim}")
        if self.conv_dim is not None and self.conv_dim < 1:
            raise ConfigError(f"--conv_dim: expected an integer >= 1, got {self.conv_dim}")
        if not 0 < self.clamp_quantile <= 1:
            raise ConfigError(f"--clamp_quantile: expected a number in (0, 1], got {self.clamp_quantile}")
        if self.svd not in SVD_METHODS:
            raise ConfigError(f"--svd: expected one of {', '.join(SVD_METHODS)}, got {self.svd!r}")


def quantile(values: torch.Tensor, q: float) -> float:
    """torch.quantile (linear interpolation) without its 16M-element limit."""
    flat = values.flatten().float()
    pos = q * (flat.numel() - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, flat.numel() - 1)
    lo_val = float(torch.kthvalue(flat, lo + 1).values)
    hi_val = float(torch.kthvalue(flat, hi + 1).values) if hi != lo else lo_val
    return lo_val + (hi_val - lo_val) * (pos - lo)


def top_svd(matrix: torch.Tensor, rank: int, method: str = "auto") -> lora_svd.SVD:
    """Top-`rank` SVD: randomized when `method` asks for it or ("auto") when rank is small against the matrix."""
    small_side = min(matrix.shape)
    if method == "randomized" or (method == "auto" and rank <= RANDOMIZED_MAX_FRACTION * small_side):
        return lora_svd.randomized_svd(matrix, rank)
    return lora_svd.full_svd(matrix).truncate(rank)


def extract_module(name: str, diff: torch.Tensor, rank: int, clamp_quantile: float = 0.99,
                   method: str = "auto") -> LoraModule:
    """A rank-`rank` LoRA module approximating `diff` (a Linear [out, in] or conv [out, in, k, k] difference)."""
    matrix = diff.float().flatten(1)
    rank = min(rank, *matrix.shape)
    svd = top_svd(matrix, rank, method)
    up = svd.U * svd.S
    down = svd.Vh
    if clamp_quantile < 1:
        limit = quantile(torch.cat([up.flatten(), down.flatten()]).abs(), clamp_quantile)
        up = up.clamp(-limit, limit)
        down = down.clamp(-limit, limit)
    if diff.dim() == 4:
        down = down.reshape(rank, *diff.shape[1:])
        up = up.reshape(up.shape[0], rank, 1, 1)
    return LoraModule(name, down.contiguous().cpu(), up.contiguous().cpu(), float(rank))


def layer_rank(weight: torch.Tensor, opts: ExtractOptions) -> Optional[int]:
    """--dim for Linear and 1x1 convs, --conv_dim for k×k convs (None: no LoRA for that layer)."""
    if weight.dim() == 4 and tuple(weight.shape[2:]) != (1, 1):
        return opts.conv_dim
    return opts.dim


def extract_lora(org: Mapping[str, LoraLayer], tuned: Mapping[str, LoraLayer], opts: ExtractOptions,
                 progress: Optional[Callable[[str], None]] = None) -> list[LoraModule]:
    """LoRA modules for the layers both models have; TE layers only if the text encoders differ."""
    opts.check()
    missing = sorted(set(org) ^ set(tuned))
    if missing:
        raise UserError(f"--model_tuned: the models do not have the same layers (first difference: {missing[0]})")
    for name, layer in org.items():
        if layer.weight.shape != tuned[name].weight.shape:
            raise UserError(f"--model_tuned: {name} has shape {list(tuned[name].weight.shape)}, --model_org "
                            f"{list(layer.weight.shape)}")

    def diff_of(name: str) -> torch.Tensor:
        return (tuned[name].weight.detach().to(opts.device, torch.float32)
                - org[name].weight.detach().to(opts.device, torch.float32))

    wanted = [name for name, layer in org.items() if layer_rank(layer.weight, opts) is not None]
    # One difference at a time: holding all of them would double the memory of a model.
    te_differs = any(float(diff_of(n).abs().max()) > opts.min_diff for n in wanted if org[n].is_text_encoder)
    modules = []
    for name in wanted:
        if org[name].is_text_encoder and not te_differs:
            continue
        diff = diff_of(name)
        modules.append(extract_module(name, diff, layer_rank(diff, opts), opts.clamp_quantile, opts.svd))
        if progress is not None:
            progress(name)
    return modules


def text_encoder_included(modules: list[LoraModule], org: Mapping[str, LoraLayer]) -> bool:
    return any(org[m.name].is_text_encoder for m in modules)
