"""LoRA files as the tools see them: load (any known layout), group keys per module, save with fresh metadata.

Modules are kept in kohya form: `<name>.lora_down.weight`, `<name>.lora_up.weight`
and an optional `<name>.alpha`. Files in another layout (diffusers/PEFT,
ai-toolkit) are converted on load by library/families/lora_convert.py. LyCORIS-only
algorithms (LoHa, LoKr, OFT, ...) are refused with a one-line error naming the key;
LoCon (kohya keys on convs) is an ordinary LoRA here.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

import torch

from library.core.errors import UserError
from library.core.metadata import save_lora_state_dict
from networks import lora_math

KOHYA_SUFFIXES = {"lora_down.weight": "down", "lora_up.weight": "up", "alpha": "alpha",
                  # kohya names with PEFT suffixes: sd-scripts' resize reads them too
                  "lora_A.weight": "down", "lora_B.weight": "up"}
# A key fragment that only a LyCORIS algorithm writes, and what to call it in the error.
# Each is matched against the key's suffix (after the module name).
LYCORIS_MARKERS = ((r"hada_", "LoHa"), (r"lokr_", "LoKr"), (r"oft_", "OFT/BOFT"), (r"lora_mid", "LoCon with use_tucker"),
                   (r"dora_scale", "DoRA"), (r"diff(_b)?$", "full (diff)"), (r"on_input", "IA3"),
                   (r"scalar$", "use_scalar"))
PRECISIONS = {"float": torch.float32, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class UnsupportedLoraError(UserError):
    """A file (or one of its keys) the tools do not understand."""


@dataclass
class LoraModule:
    """One kohya LoRA module: ΔW = up @ down · alpha / rank (alpha None: scale 1)."""

    name: str
    down: torch.Tensor
    up: torch.Tensor
    alpha: Optional[float] = None

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def scale(self) -> float:
        return lora_math.lora_scale(self.alpha, self.rank)

    @property
    def is_conv(self) -> bool:
        """A k×k conv (k > 1): resized with --new_conv_rank, extracted with --conv_dim."""
        return self.down.dim() == 4 and tuple(self.down.shape[2:]) != (1, 1)

    @property
    def out_features(self) -> int:
        return self.up.shape[0]

    @property
    def in_flat(self) -> int:
        """Columns of the flattened ΔW: in_features, or in_channels·k·k for a conv."""
        return self.down[0].numel()

    def factors(self, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(up [out, r], down [r, in·k²]) as float32 on `device`; ΔW = up @ down · scale."""
        return (self.up.reshape(self.up.shape[0], -1).to(device, torch.float32),
                self.down.reshape(self.rank, -1).to(device, torch.float32))

    def delta(self) -> torch.Tensor:
        """ΔW in float32, laid out like the base weight."""
        return lora_math.delta_weight(self.down.float(), self.up.float(), self.alpha)

    def with_factors(self, up2d: torch.Tensor, down2d: torch.Tensor, alpha: Optional[float]) -> "LoraModule":
        """A module of the same layer type from 2-D factors (conv shapes restored)."""
        rank = down2d.shape[0]
        if self.down.dim() == 4:
            down = down2d.reshape(rank, *self.down.shape[1:])
            up = up2d.reshape(up2d.shape[0], rank, 1, 1)
        else:
            down, up = down2d, up2d
        return LoraModule(self.name, down.contiguous(), up.contiguous(), alpha)


@dataclass
class LoraFile:
    """A loaded LoRA: modules by name (file order), the file's metadata and tensor dtype."""

    path: str
    modules: dict[str, LoraModule]
    metadata: dict[str, str] = field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    layout: str = "kohya"


def parse_precision(value: Optional[str], flag: str = "--save_precision") -> Optional[torch.dtype]:
    """"float" / "fp16" / "bf16" to a dtype; None stays None (keep the input's dtype)."""
    if value is None:
        return None
    if value not in PRECISIONS:
        raise UserError(f"{flag}: expected one of float, fp16, bf16, got {value!r}")
    return PRECISIONS[value]


def lycoris_algo(key: str) -> Optional[str]:
    """The LyCORIS-only algorithm a key belongs to ("LoHa", "LoKr", ...), or None for LoRA/LoCon keys."""
    suffix = key.partition(".")[2]  # kohya: everything after the module name
    return next((algo for marker, algo in LYCORIS_MARKERS if re.match(marker, suffix)), None)


def check_not_lycoris(keys: Iterable[str], source: str) -> None:
    """Refuse LyCORIS-only algorithms with the first key that shows which one."""
    for key in keys:
        algo = lycoris_algo(key)
        if algo:
            raise UnsupportedLoraError(f"{source}: {key}: a LyCORIS {algo} module; only LoRA/LoCon "
                                       f"(lora_down/lora_up) files are supported by this tool")


def group_modules(state_dict: Mapping[str, torch.Tensor], source: str) -> dict[str, LoraModule]:
    """Kohya keys grouped per module; one-line error on the first key that does not fit."""
    check_not_lycoris(state_dict, source)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        name, _, suffix = key.partition(".")
        if suffix not in KOHYA_SUFFIXES or not name.startswith("lora_"):
            raise UnsupportedLoraError(f"{source}: unexpected key {key!r}; expected <lora_name>.lora_down.weight, "
                                       f".lora_up.weight or .alpha")
        parts.setdefault(name, {})[KOHYA_SUFFIXES[suffix]] = value
    modules = {}
    for name, p in parts.items():
        if "down" not in p or "up" not in p:
            missing = "lora_up.weight" if "down" in p else "lora_down.weight"
            raise UnsupportedLoraError(f"{source}: {name}.{missing} is missing")
        down, up = p["down"], p["up"]
        if up.shape[1] != down.shape[0] or down.dim() != up.dim():
            raise UnsupportedLoraError(f"{source}: {name}: lora_up {list(up.shape)} does not fit "
                                       f"lora_down {list(down.shape)}")
        alpha = float(p["alpha"].float()) if "alpha" in p else None
        modules[name] = LoraModule(name, down, up, alpha)
    return modules


def read_state_dict(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a .safetensors file (or a torch pickle of tensors, no metadata)."""
    if not os.path.isfile(path):
        raise UserError(f"{path}: file not found")
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
        except Exception as e:  # safetensors raises its own error types for a damaged header
            raise UserError(f"{path}: not a readable safetensors file ({e})") from None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise UserError(f"{path}: expected a dict of tensors")
    return state, {}




def modules_state_dict(modules: Iterable[LoraModule], dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """Kohya keys for `modules` (down, up, alpha as a 0-dim tensor), cast to `dtype` when given."""
    out: dict[str, torch.Tensor] = {}
    for m in modules:
        d = dtype or m.down.dtype
        out[f"{m.name}.lora_down.weight"] = m.down.detach().to("cpu", d).contiguous()
        out[f"{m.name}.lora_up.weight"] = m.up.detach().to("cpu", d).contiguous()
        alpha = m.rank if m.alpha is None else m.alpha
        out[f"{m.name}.alpha"] = torch.tensor(float(alpha), dtype=d)
    return out


def updated_metadata(metadata: Mapping[str, str], network_dim: object, network_alpha: object,
                     comment: str) -> dict[str, str]:
    """Copy of `metadata` with new ss_network_dim/alpha and `comment` prefixed to ss_training_comment.

    Stale hashes are dropped; `save_lora_file` writes fresh ones.
    """
    md = {k: v for k, v in metadata.items() if not k.startswith("sshs_") and k != "modelspec.hash_sha256"}
    md["ss_network_dim"] = str(network_dim)
    md["ss_network_alpha"] = str(network_alpha)
    old = md.get("ss_training_comment")
    md["ss_training_comment"] = f"{comment}; {old}" if old and old != "None" else comment
    return md


def save_lora_file(path: str, modules: Iterable[LoraModule], metadata: Mapping[str, str],
                   dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """Write kohya modules atomically with metadata and recomputed sshs_* hashes; return what was written."""
    state = modules_state_dict(modules, dtype)
    save_lora_state_dict(path, state, dict(metadata))
    return state


def dim_alpha_summary(modules: Iterable[LoraModule], integer_alpha: bool = False) -> tuple[str, str]:
    """ss_network_dim / ss_network_alpha values: the common value, or "Dynamic" when modules differ.

    The alpha is written as sd-scripts' tools write it: a float ("4.0", resize and extract) or, with
    `integer_alpha`, an integral value without the ".0" ("6", svd_merge).
    """
    mods = list(modules)
    ranks = {m.rank for m in mods}
    alphas = {m.rank if m.alpha is None else m.alpha for m in mods}
    dim = str(ranks.pop()) if len(ranks) == 1 else "Dynamic"
    if len(alphas) != 1:
        return dim, "Dynamic"
    value = float(alphas.pop())
    return dim, str(int(value)) if integer_alpha and value.is_integer() else str(value)


def summarize(lora: LoraFile) -> dict:
    """What show_metadata prints: model parts, module counts, ranks and alphas found."""
    by_prefix: dict[str, int] = {}
    for name in lora.modules:
        prefix = "_".join(name.split("_")[:2])  # lora_unet, lora_te, lora_te1, ...
        by_prefix[prefix] = by_prefix.get(prefix, 0) + 1
    ranks = sorted({m.rank for m in lora.modules.values()})
    alphas = sorted({m.rank if m.alpha is None else m.alpha for m in lora.modules.values()})
    return {
        "layout": lora.layout,
        "base_model_version": lora.metadata.get("ss_base_model_version", "unknown"),
        "modules": len(lora.modules),
        "modules_by_part": dict(sorted(by_prefix.items())),
        "conv_modules": sum(m.is_conv for m in lora.modules.values()),
        "ranks": ranks,
        "alphas": [float(a) for a in alphas],
        "dtype": str(lora.dtype).replace("torch.", ""),
        "network_module": lora.metadata.get("ss_network_module", "unknown"),
        "network_args": json.loads(lora.metadata["ss_network_args"]) if lora.metadata.get("ss_network_args", "")
        .startswith("{") else None,
    }


def summarize_lycoris(state_dict: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> dict:
    """show_metadata's summary of a file with LyCORIS-only modules: parts, algorithms and module counts."""
    algos: dict[str, str] = {}
    for key in state_dict:
        name = key.partition(".")[0]
        algo = lycoris_algo(key)
        if algo or name not in algos:
            algos[name] = algo or algos.get(name) or "LoRA/LoCon"
    by_part: dict[str, int] = {}
    for name in algos:
        part = "lycoris" if name.startswith("lycoris_") else "_".join(name.split("_")[:2])
        by_part[part] = by_part.get(part, 0) + 1
    by_algo: dict[str, int] = {}
    for algo in algos.values():
        by_algo[algo] = by_algo.get(algo, 0) + 1
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in state_dict.values()})
    return {
        "layout": "lycoris",
        "base_model_version": metadata.get("ss_base_model_version", "unknown"),
        "modules": len(algos),
        "modules_by_part": dict(sorted(by_part.items())),
        "algorithms": dict(sorted(by_algo.items())),
        "dtype": dtypes[0] if len(dtypes) == 1 else dtypes,
        "network_module": metadata.get("ss_network_module", "unknown"),
        "network_args": json.loads(metadata["ss_network_args"]) if metadata.get("ss_network_args", "")
        .startswith("{") else None,
    }

