"""Low-rank SVD of a LoRA's ΔW and the rules that pick the rank to keep.

A LoRA module's ΔW = up @ down has rank ≤ r, so its SVD never needs a full SVD of
the out × in matrix: QR-factor both factors (up = Qu·Ru, downᵀ = Qd·Rd), take the
SVD of the r × r core Ru·Rdᵀ = Uc·S·Vcᵀ, and ΔW = (Qu·Uc)·S·(Qd·Vc)ᵀ. The cost is
O((out + in)·r²) instead of O(out·in·min(out, in)).

Rank rules follow sd-scripts' resize_lora (inventory §11), including its quirk that
a dynamic method's index is clamped to [1, n−1] and then incremented by one, and
the score "recipes" of elias-gaeros' resize_lora (`fro_ckpt=1,thr=-3.55`), which
compare singular values with norms of the base model's weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from library.core.errors import ConfigError

MIN_SV = 1e-6  # below this the first singular value counts as a zero matrix (sd-scripts)
DYNAMIC_METHODS = ("sv_ratio", "sv_fro", "sv_cumulative", "recipe")
RECIPE_WEIGHTS = ("spn_ckpt", "fro_ckpt", "spn_lora", "fro_lora")


@dataclass(frozen=True)
class SVD:
    """Thin SVD: matrix = U @ diag(S) @ Vh, S descending. U is [out, k], Vh is [k, in]."""

    U: torch.Tensor
    S: torch.Tensor
    Vh: torch.Tensor

    def truncate(self, k: int) -> "SVD":
        return SVD(self.U[:, :k], self.S[:k], self.Vh[:k])

    def matrix(self) -> torch.Tensor:
        return (self.U * self.S) @ self.Vh


def factor_svd(up: torch.Tensor, down: torch.Tensor) -> SVD:
    """SVD of up @ down from the factors (up [out, r], down [r, in]); float64-free, in the inputs' dtype."""
    qu, ru = torch.linalg.qr(up)  # [out, p], [p, r]
    qd, rd = torch.linalg.qr(down.T)  # [in, q], [q, r]
    uc, s, vhc = torch.linalg.svd(ru @ rd.T, full_matrices=False)
    return SVD(qu @ uc, s, vhc @ qd.T)


def full_svd(matrix: torch.Tensor) -> SVD:
    """Reference: the plain SVD of a dense matrix (what sd-scripts does)."""
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    return SVD(u, s, vh)


def randomized_svd(matrix: torch.Tensor, rank: int, oversample: int = 10, niter: int = 2) -> SVD:
    """Top-`rank` SVD by randomized range finding (Halko et al.), much faster than a full SVD for rank ≪ min(out, in)."""
    q = min(rank + oversample, *matrix.shape)
    u, s, v = torch.svd_lowrank(matrix, q=q, niter=niter)
    return SVD(u[:, :rank], s[:rank], v[:, :rank].T)


# --- rank rules -------------------------------------------------------------------


def _clamp_index(index: int, full_len: int) -> int:
    return max(1, min(index, full_len - 1))


def index_sv_ratio(S: torch.Tensor, ratio: float, full_len: int) -> int:
    """sd-scripts: count of singular values above S0/ratio, clamped to [1, n-1]."""
    return _clamp_index(int((S > S[0] / ratio).sum()), full_len)


def index_sv_cumulative(S: torch.Tensor, target: float, full_len: int) -> int:
    """sd-scripts: 1 + first index where the cumulative Σσ fraction reaches `target`, clamped."""
    cumulative = torch.cumsum(S, 0) / S.sum()
    return _clamp_index(int(torch.searchsorted(cumulative, torch.tensor(target, dtype=S.dtype))) + 1, full_len)


def index_sv_fro(S: torch.Tensor, target: float, full_len: int) -> int:
    """sd-scripts: 1 + first index where the retained Frobenius² fraction reaches target², clamped."""
    sq = S.pow(2)
    cumulative = torch.cumsum(sq, 0) / sq.sum()
    return _clamp_index(int(torch.searchsorted(cumulative, torch.tensor(target ** 2, dtype=S.dtype))) + 1, full_len)


@dataclass(frozen=True)
class ScoreRecipe:
    """An elias-gaeros style recipe: keep σᵢ where log10(σᵢ) − Σ wⱼ·log10(refⱼ) > thr.

    References: spn_ckpt / fro_ckpt are the spectral / Frobenius norm of the base
    model's weight, spn_lora / fro_lora those of ΔW itself. Weights are normalised
    to sum to 1, as in the original tool.
    """

    weights: dict[str, float]
    threshold: float

    @property
    def needs_base(self) -> bool:
        return any(self.weights.get(k, 0.0) for k in ("spn_ckpt", "fro_ckpt"))


def parse_recipe(text: str, flag: str = "--dynamic_param") -> ScoreRecipe:
    """Parse "fro_ckpt=1,thr=-3.55" (a bare key means weight 1)."""
    weights = {k: 0.0 for k in RECIPE_WEIGHTS}
    threshold: Optional[float] = None
    for part in str(text).split(","):
        key, _, value = part.strip().partition("=")
        if key not in weights and key != "thr":
            hint = " (size= needs a whole-file search, not supported: use thr=)" if key == "size" else ""
            raise ConfigError(f"{flag}: unknown recipe key {key!r} in {text!r}; expected "
                              f"{', '.join(RECIPE_WEIGHTS)} and thr{hint}")
        try:
            number = float(value) if value else 1.0
        except ValueError:
            raise ConfigError(f"{flag}: {key}={value!r} in {text!r} is not a number") from None
        if key == "thr":
            threshold = number
        else:
            weights[key] = number
    total = sum(weights.values())
    if threshold is None or total == 0:
        raise ConfigError(f"{flag}: recipe {text!r} needs thr=<log10 threshold> and at least one of "
                          f"{', '.join(RECIPE_WEIGHTS)}, e.g. fro_ckpt=1,thr=-3.55")
    return ScoreRecipe({k: v / total for k, v in weights.items()}, threshold)


def recipe_rank(S: torch.Tensor, recipe: ScoreRecipe, base_weight: Optional[torch.Tensor]) -> int:
    """How many singular values of ΔW (scale included) score above the recipe's threshold."""
    if S.numel() == 0 or float(S[0]) <= 0:
        return 0
    offset = 0.0
    w = recipe.weights
    if w["spn_lora"]:
        offset += w["spn_lora"] * math.log10(float(S[0]))
    if w["fro_lora"]:
        offset += w["fro_lora"] * math.log10(float(S.norm()))
    if recipe.needs_base:
        if base_weight is None:
            raise ConfigError("--dynamic_method recipe with spn_ckpt/fro_ckpt needs --base_model")
        flat = base_weight.detach().float().flatten(1)
        if w["fro_ckpt"]:
            offset += w["fro_ckpt"] * math.log10(float(flat.norm()))
        if w["spn_ckpt"]:
            offset += w["spn_ckpt"] * math.log10(float(torch.linalg.matrix_norm(flat, ord=2)))
    scores = torch.log10(S.clamp_min(1e-30)) - offset
    return int((scores > recipe.threshold).sum())


@dataclass(frozen=True)
class RankRule:
    """How to choose a module's new rank: fixed `max_rank`, or a dynamic method capped at it."""

    max_rank: int
    method: Optional[str] = None
    param: Optional[float] = None
    recipe: Optional[ScoreRecipe] = None


def choose_rank(S: torch.Tensor, rule: RankRule, full_len: Optional[int] = None) -> int:
    """The rank sd-scripts' resize_lora keeps for singular values `S` (of up @ down, scale excluded).

    `full_len` is min(out, in·k²), the length of the full spectrum sd-scripts clamps
    against; our spectrum holds only the ≤ r nonzero values. Dynamic methods give
    index + 1 (the sd-scripts rule), then every method is capped at `max_rank`;
    a zero matrix keeps rank 1.
    """
    n = full_len if full_len is not None else S.numel()
    if rule.method is None:
        rank = rule.max_rank
    elif rule.method == "sv_ratio":
        rank = index_sv_ratio(S, rule.param, n) + 1
    elif rule.method == "sv_cumulative":
        rank = index_sv_cumulative(S, rule.param, n) + 1
    elif rule.method == "sv_fro":
        rank = index_sv_fro(S, rule.param, n) + 1
    else:
        raise ConfigError(f"--dynamic_method: expected one of {', '.join(DYNAMIC_METHODS)}, got {rule.method!r}")
    if float(S[0]) <= MIN_SV:
        return 1
    return min(rank, rule.max_rank)


def retained_fractions(S: torch.Tensor, rank: int) -> tuple[float, float, float]:
    """(Σσ kept / Σσ, ‖ΔW_k‖_F / ‖ΔW‖_F, S0 / S_{k-1}): what --verbose prints per module."""
    total = float(S.sum())
    fro = float(S.pow(2).sum().sqrt())
    kept = S[:rank]
    sum_frac = float(kept.sum()) / total if total else 1.0
    fro_frac = float(kept.pow(2).sum().sqrt()) / fro if fro else 1.0
    last = float(kept[-1]) if kept.numel() else 0.0
    ratio = float(S[0]) / last if last else math.inf
    return sum_frac, fro_frac, ratio
