"""ΔW of LyCORIS modules (LoHa, LoKr, LoCon with Tucker or DoRA, OFT/BOFT, IA3, full, GLoRA) from a state dict.

The math is LyCORIS' own: each module is rebuilt with `lycoris.modules.get_module` /
`make_module_from_state_dict` over a stand-in layer holding the base weight, and asked for
`get_diff_weight` (additive kinds) or `get_merged_weight` (kinds whose result depends on the base
weight: DoRA, OFT/BOFT, IA3, GLoRA). Nothing here knows a model family: a tool hands in the base
weights (or only their shapes) by module name.

A plain LoRA module of such a file (lora_down / lora_up / alpha, no Tucker `lora_mid`, no
`dora_scale`) stays a `LoraModule`, so its ΔW keeps its low-rank form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Union

import torch
from torch import nn

from library.core.errors import UserError
from networks import lora_svd
from networks.lora_files import (
    KOHYA_SUFFIXES,
    LoraFile,
    LoraModule,
    UnsupportedLoraError,
    lycoris_algo,
    read_state_dict,
)

# LyCORIS module class -> the name the tools print; kinds whose ΔW is the same whatever the base weight.
KIND_NAMES = {"LoConModule": "LoCon", "LohaModule": "LoHa", "LokrModule": "LoKr", "FullModule": "full",
              "IA3Module": "IA3", "DiagOFTModule": "OFT", "ButterflyOFTModule": "BOFT", "GLoRAModule": "GLoRA",
              "NormModule": "norm"}
ADDITIVE = {"LoCon", "LoHa", "LoKr", "full"}
# sd-scripts' networks.oft / oft_flux files (`oft_unet_*.oft_blocks[.i]`) share LyCORIS' key name but not its
# constraint (alpha × rows of each part).
SD_SCRIPTS_OFT, SD_SCRIPTS_OFT_PREFIX = "OFT (networks.oft)", "oft_unet_"

AnyModule = Union[LoraModule, "LycorisModule"]


def is_lycoris_state(keys) -> bool:
    """Whether any key belongs to a LyCORIS-only algorithm (LoHa, LoKr, OFT, IA3, DoRA, Tucker, full, ...)."""
    return any(lycoris_algo(k) for k in keys)


@dataclass
class LycorisModule:
    """One LyCORIS module: its name, kind ("LoKr", "LoHa+DoRA", ...) and tensors by suffix ("lokr_w1", ...)."""

    name: str
    kind: str
    tensors: dict[str, torch.Tensor]
    source: str = "LyCORIS file"

    @property
    def needs_base(self) -> bool:
        """Whether ΔW depends on the base weight (DoRA, OFT/BOFT, IA3, GLoRA): then only a model gives it."""
        return self.kind not in ADDITIVE

    def file_shape(self) -> Optional[tuple[int, ...]]:
        """The layer's weight shape as far as the tensors tell it; a conv whose factors are stored flat
        (LoHa, LoKr without Tucker) comes out as [out, in·k·k]. None when only the base weight tells it."""
        t = self.tensors
        if "diff" in t:
            return tuple(t["diff"].shape)
        if "lora_up.weight" in t:
            up, down, mid = t["lora_up.weight"], t["lora_down.weight"], t.get("lora_mid.weight")
            kernel = tuple((mid if mid is not None else down).shape[2:])
            return (up.shape[0], down.shape[1], *kernel)
        if "hada_w1_a" in t:
            out = t["hada_w1_a"].shape[1 if "hada_t1" in t else 0]
            kernel = tuple(t["hada_t1"].shape[2:]) if "hada_t1" in t else ()
            return (out, t["hada_w1_b"].shape[1], *kernel)
        if any(k.startswith("lokr_w1") for k in t):
            o1, i1 = t["lokr_w1"].shape if "lokr_w1" in t else (t["lokr_w1_a"].shape[0], t["lokr_w1_b"].shape[1])
            if "lokr_w2" in t:
                o2, i2, *kernel = t["lokr_w2"].shape
            elif "lokr_t2" in t:
                o2, i2, kernel = t["lokr_w2_a"].shape[1], t["lokr_w2_b"].shape[1], list(t["lokr_t2"].shape[2:])
            else:
                o2, i2, kernel = t["lokr_w2_a"].shape[0], t["lokr_w2_b"].shape[1], []
            return (o1 * o2, i1 * i2, *kernel)
        return None

    def numel(self) -> Optional[int]:
        shape = self.file_shape()
        return None if shape is None else int(torch.tensor(shape).prod())

    def _rebuilt(self, weight: torch.Tensor) -> nn.Module:
        """LyCORIS' own module for this one, over a stand-in layer whose weight is `weight` (float32)."""
        from lycoris.modules import get_module

        state = {f"{self.name}.{k}": v.float() for k, v in self.tensors.items()}
        cls, params = get_module(state, self.name)
        if weight.dim() == 2:
            layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        elif weight.dim() == 4:
            layer = nn.Conv2d(weight.shape[1], weight.shape[0], tuple(weight.shape[2:]), bias=False)
        else:
            raise UnsupportedLoraError(f"{self.source}: {self.name}: a {self.kind} module on a "
                                       f"{weight.dim()}-D weight; only Linear and Conv2d layers are supported")
        layer.weight = nn.Parameter(weight, requires_grad=False)
        try:
            with torch.no_grad():
                module = cls.make_module_from_state_dict(self.name, layer, *params)
        except (RuntimeError, ValueError, TypeError, AttributeError) as e:  # missing tensors, shapes that do not fit
            raise UnsupportedLoraError(f"{self.source}: {self.name}: the {self.kind} tensors do not fit a layer of "
                                       f"shape {list(weight.shape)} ({e})") from None
        return module.eval()

    def delta(self, base: Optional[torch.Tensor] = None, multiplier: float = 1.0) -> torch.Tensor:
        """ΔW (float32, laid out like `base`, else like `file_shape()`) at `multiplier`, as LyCORIS merges it:
        W + multiplier·ΔW for additive kinds, LyCORIS' merged weight minus W for the others."""
        if self.kind == SD_SCRIPTS_OFT and base is not None:
            from networks.oft import block_rotation, rotated_weight

            weight = base.detach().to("cpu", torch.float32)
            parts = _oft_parts(self.tensors)  # networks.oft_flux: one per part of a fused layer, in row order
            rows = [p.shape[0] * p.shape[1] for p in parts]
            if weight.shape[0] != sum(rows):
                raise UserError(f"{self.source}: {self.name}: OFT blocks for {sum(rows)} rows do not fit the base "
                                f"weight {list(weight.shape)}")
            alpha = float(self.tensors["alpha"])
            turned = [rotated_weight(w, block_rotation(p, alpha * w.shape[0], multiplier))
                      for p, w in zip(parts, weight.split(rows, dim=0))]
            return torch.cat(turned, dim=0) - weight
        if base is None:
            if self.needs_base:
                what = f"an {self.kind}" if self.kind == SD_SCRIPTS_OFT else f"a LyCORIS {self.kind}"
                raise UserError(f"{self.source}: {self.name}: {what} module: its ΔW depends on the "
                                f"base model's weight; give the base model (merge_lora.py --sd_model, "
                                f"resize_lora.py --base_model)")
            shape = self.file_shape()
            weight = torch.zeros(shape)
        else:
            weight = base.detach().to("cpu", torch.float32)
            shape = tuple(weight.shape)
            known = self.numel()
            if known is not None and known != weight.numel():
                raise UserError(f"{self.source}: {self.name}: ΔW has {known} values ({list(self.file_shape())}) but "
                                f"the base weight is {list(weight.shape)}")
        module = self._rebuilt(weight)
        with torch.no_grad():
            if self.needs_base:
                merged = module.get_merged_weight(multiplier=multiplier, shape=module.shape,
                                                  device=weight.device)[0]
                diff = merged.float() - weight.reshape(merged.shape)
            else:
                diff = module.get_diff_weight(multiplier=multiplier, shape=module.shape, device=weight.device)[0]
        return diff.float().reshape(shape)

    def merged_weight(self, weight: torch.Tensor, ratio: float = 1.0) -> torch.Tensor:
        """weight with this module merged at `ratio` (float32 math), in weight's dtype and device."""
        return (weight.to(torch.float32) + self.delta(weight, ratio).to(weight.device)).to(weight.dtype)


def group_lycoris_modules(state: Mapping[str, torch.Tensor], source: str) -> dict[str, AnyModule]:
    """Every module of a LyCORIS file by name, in file order: plain LoRA modules as LoraModule, the rest as
    LycorisModule; a one-line error for a key no LyCORIS module owns."""
    from lycoris.modules import get_module

    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        name, _, suffix = key.partition(".")
        parts.setdefault(name, {})[suffix] = value
    modules: dict[str, AnyModule] = {}
    for name, tensors in parts.items():
        if set(tensors) <= set(KOHYA_SUFFIXES) and "lora_up.weight" in tensors and "lora_down.weight" in tensors:
            alpha = tensors.get("alpha")
            modules[name] = LoraModule(name, tensors["lora_down.weight"], tensors["lora_up.weight"],
                                       None if alpha is None else float(alpha.float()))
            continue
        if name.startswith(SD_SCRIPTS_OFT_PREFIX) and _sd_scripts_oft_keys(tensors):
            modules[name] = LycorisModule(name, SD_SCRIPTS_OFT, tensors, source)  # not LyCORIS' constraint
            continue
        full = {f"{name}.{k}": v for k, v in tensors.items()}
        cls, _ = get_module(full, name)
        if cls is None or cls.__name__ not in KIND_NAMES:
            raise UnsupportedLoraError(f"{source}: {name}.{next(iter(tensors))}: no LyCORIS module this tool "
                                       f"knows owns this key (LoCon, LoHa, LoKr, DoRA, OFT, BOFT, IA3, full, GLoRA)")
        known = set(cls.weight_list)
        unknown = sorted(set(tensors) - known - {"on_input"})
        if unknown:
            raise UnsupportedLoraError(f"{source}: {name}.{unknown[0]}: not a key of a LyCORIS "
                                       f"{KIND_NAMES[cls.__name__]} module")
        kind = KIND_NAMES[cls.__name__] + ("+DoRA" if "dora_scale" in tensors else "")
        module = LycorisModule(name, kind, tensors, source)
        try:
            module.file_shape()
        except KeyError as e:
            raise UnsupportedLoraError(f"{source}: {name}.{e.args[0]} is missing (a LyCORIS {kind} module)") from None
        modules[name] = module
    return modules


def lora_module_name(name: str) -> str:
    """The kohya LoRA name of the layer a module adapts: sd-scripts' OFT writes `oft_unet_<path>` for the layer
    `lora_unet_<path>` names; every other name is one already."""
    return "lora_unet_" + name[len(SD_SCRIPTS_OFT_PREFIX):] if name.startswith(SD_SCRIPTS_OFT_PREFIX) else name


def _sd_scripts_oft_keys(tensors: Mapping[str, torch.Tensor]) -> bool:
    """networks.oft (`oft_blocks`, `alpha`) or networks.oft_flux (`oft_blocks.<i>` per part, `alpha`)."""
    parts = set(tensors) - {"alpha"}
    return "alpha" in tensors and (parts == {"oft_blocks"} or
                                   parts == {f"oft_blocks.{i}" for i in range(len(parts))} != set())


def _oft_parts(tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    if "oft_blocks" in tensors:
        return [tensors["oft_blocks"]]
    return [tensors[f"oft_blocks.{i}"] for i in range(len(tensors) - 1)]


def exact_lora(module: AnyModule, base: Optional[torch.Tensor] = None) -> LoraModule:
    """A plain LoRA module with exactly this module's ΔW: ΔW itself as one factor and the identity as the other
    (rank min(out, in·k²), alpha = rank), so the tools' factor SVD and stacking apply unchanged."""
    if isinstance(module, LoraModule):
        return module
    dw = module.delta(base)
    out, flat = dw.shape[0], dw[0].numel()
    dw2 = dw.reshape(out, flat)
    if out <= flat:
        up, down = torch.eye(out), dw2
    else:
        up, down = dw2, torch.eye(flat)
    rank = down.shape[0]
    if dw.dim() == 4:
        down, up = down.reshape(rank, *dw.shape[1:]), up.reshape(out, rank, 1, 1)
    return LoraModule(lora_module_name(module.name), down.contiguous(), up.contiguous(), float(rank))


def refactored_lora(module: AnyModule, rank: int, base: Optional[torch.Tensor] = None,
                    device: str | torch.device = "cpu") -> LoraModule:
    """The best rank-`rank` plain LoRA (Eckart–Young) of this module's ΔW, alpha = rank."""
    exact = exact_lora(module, base)
    up, down = exact.factors(device)
    up = up * exact.scale
    rank = max(1, min(rank, exact.out_features, exact.in_flat))
    svd = lora_svd.factor_svd(up, down).truncate(rank)
    got = svd.S.numel()
    return exact.with_factors((svd.U * svd.S).cpu(), svd.Vh.cpu(), float(got))


def load_lycoris_file(path: str, state: Optional[Mapping[str, torch.Tensor]] = None,
                      metadata: Optional[Mapping[str, str]] = None) -> LoraFile:
    """A file with LyCORIS-only modules as a LoraFile (layout "lycoris") whose modules are LoraModule or
    LycorisModule; `state` / `metadata` when already read."""
    if state is None:
        state, metadata = read_state_dict(path)
    dtypes = [v.dtype for k, v in state.items() if not k.endswith(".alpha") and v.is_floating_point()]
    return LoraFile(path, group_lycoris_modules(state, path), dict(metadata or {}),
                    dtypes[0] if dtypes else torch.float32, "lycoris")


def exact_loras(modules: Mapping[str, AnyModule],
                bases: Optional[Mapping[str, torch.Tensor]] = None) -> dict[str, LoraModule]:
    """exact_lora of every module (`bases`: base weights by module name, for the kinds that need them)."""
    bases = bases or {}
    out = {}
    for name, m in modules.items():
        plain = exact_lora(m, bases.get(name))
        out[plain.name] = plain
    return out


def as_lora_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    """Metadata for a plain LoRA made from a LyCORIS file: it is no longer a lycoris.kohya network, so the
    module and its algorithm arguments (algo=lokr, ...) are not passed on."""
    md = dict(metadata)
    if md.get("ss_network_module", "").startswith("lycoris"):
        md["ss_network_module"] = "networks.lora"
        md.pop("ss_network_args", None)
    return md
