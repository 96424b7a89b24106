"""--base_model_precision / --text_encoder_precision: frozen Linear weights stored quantized by a library.

Every value names its format and the library that serves it (docs/quantization.md says why each):

| value          | weights                         | library                                  |
|----------------|---------------------------------|------------------------------------------|
| `no_change`    | the training dtype              | -                                        |
| `int8-quanto`  | int8, per output channel        | optimum-quanto (`QLinear`, qint8)        |
| `int4-quanto`  | int4, groups of 128 (or fewer)  | optimum-quanto (`QLinear`, qint4)        |
| `fp8-quanto`   | float8 e4m3, per channel scale  | optimum-quanto (`QLinear`, qfloat8)      |
| `int8-torchao` | int8, per output channel        | torchao (`Int8WeightOnlyConfig`)         |
| `fp8-torchao`  | float8 e4m3, per channel scale  | torchao (`Float8WeightOnlyConfig`)       |
| `nf4-bnb`      | NormalFloat4, blocks of 64      | bitsandbytes (`Linear4bit`, nf4)         |
| `fp8-torchao-dynamic` | float8 e4m3 weights and activations (row scales) | torchao (`Float8DynamicActivationFloat8WeightConfig`), CUDA >= 8.9 only |

GGUF base files (a `.gguf` `--pretrained_model_name_or_path`, already quantized) are not a value of these flags: the
family loaders read them with library/families/common/gguf_file.py (gguf + diffusers' GGUF layers).

No kernel here is ours: each layer is handed to its library, which stores the weight and runs the
matmul (dequantizing or with its own kernel). Only `nn.Linear` layers are quantized (Conv2d, norms and
embeddings keep the training dtype), and not those a model class keeps in float32
(`_keep_in_fp32_modules`). The layers are quantized one at a time in module order (block by block), each
layer's full-precision weight dropped as its quantized layer takes its place, so the model never holds two
copies of more than one layer. Quantize on load: a family loader that reads a `.safetensors` file whose dtype
is the training dtype adopts safetensors' memory-mapped views (nothing is read until touched), so quantizing
reads one layer's pages from the file; once that layer's float weight is gone its pages are handed back to the
OS (`madvise(MADV_DONTNEED)` on the file-backed range; the mapping is private and read-only in use), so the
peak host memory is the quantized model plus one layer, not the full-precision model.

A LoRA wraps the quantized layer's forward (networks/lora_module.py replaces `module.forward`), so the
frozen quantized matmul runs first and the LoRA adds its product in the training dtype; the LoRA's file
does not depend on the base's storage. Every backend's layer is still an `nn.Linear` (a subclass, or the
same class with a quantized weight), with `in_features` / `out_features`, so the LoRA targets are found
as before.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import mmap
import sys
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)

NO_CHANGE = "no_change"


@dataclass(frozen=True)
class Precision:
    """One value of the flags: the library that serves it (its import name and pip name) and its format."""
    value: str
    package: str  # the import name checked before loading
    pip_name: str
    bits: int
    what: str
    cuda_capability: Optional[tuple[int, int]] = None  # the least CUDA capability its kernels need on a GPU
    cuda_only: bool = False  # its kernels exist only on CUDA (no CPU fallback)


PRECISIONS: dict[str, Precision] = {p.value: p for p in (
    Precision("int8-quanto", "optimum.quanto", "optimum-quanto", 8, "int8 weights, per-channel scales"),
    Precision("int4-quanto", "optimum.quanto", "optimum-quanto", 4, "int4 weights, group scales"),
    Precision("fp8-quanto", "optimum.quanto", "optimum-quanto", 8, "float8 e4m3 weights, per-channel scales"),
    Precision("int8-torchao", "torchao", "torchao", 8, "int8 weights, per-channel scales"),
    Precision("fp8-torchao", "torchao", "torchao", 8, "float8 e4m3 weights, per-channel scales", (8, 9)),
    Precision("nf4-bnb", "bitsandbytes", "bitsandbytes", 4, "NormalFloat4 weights, blocks of 64"),
    Precision("fp8-torchao-dynamic", "torchao", "torchao", 8,
              "float8 e4m3 weights and activations quantized per row at run time", (8, 9), cuda_only=True),
)}
CHOICES: tuple[str, ...] = (NO_CHANGE, *PRECISIONS)


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def precision_unavailable(value: str, cuda: Optional[bool] = None) -> Optional[str]:
    """Why `value` cannot run here (its library is not installed, or this GPU lacks its kernels), or None.

    `cuda`: whether training runs on a CUDA device (default: whether one is available)."""
    if value == NO_CHANGE:
        return None
    p = PRECISIONS.get(value)
    if p is None:
        return f"unknown value {value!r}; expected one of {', '.join(CHOICES)}"
    if not _installed(p.package):
        return f"{value} needs the {p.pip_name} package, which is not installed (pip install {p.pip_name})"
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if p.cuda_only and not cuda:
        need = ".".join(map(str, p.cuda_capability or (0, 0)))
        return (f"{value} needs a CUDA GPU of capability {need} or newer (float8 matmuls of weights and "
                f"activations; there is no CPU kernel) and this run has none; use fp8-torchao or int8-quanto")
    if cuda and p.cuda_capability and torch.cuda.get_device_capability() < p.cuda_capability:
        have = ".".join(map(str, torch.cuda.get_device_capability()))
        need = ".".join(map(str, p.cuda_capability))
        return f"{value} needs a GPU of CUDA capability {need} or newer (this one has {have}); use int8-quanto"
    return None


# ---------------------------------------------------------------------------- one layer, by its library

def _quanto(weights: str) -> Callable[[nn.Linear], nn.Module]:
    def quantize(linear: nn.Linear) -> nn.Module:
        from optimum import quanto
        from optimum.quanto.nn import QLinear

        q = QLinear.from_module(linear, weights=getattr(quanto, weights))
        q.freeze()  # the weight becomes the quantized tensor; the float one is dropped
        return q.requires_grad_(False)
    return quantize


def _torchao(config: str) -> Callable[[nn.Linear], nn.Module]:
    def quantize(linear: nn.Linear) -> nn.Module:
        import torchao.quantization as ao

        holder = nn.Sequential(linear)  # quantize_ swaps the weights of the Linear layers under a module
        ao.quantize_(holder, getattr(ao, config)())
        return holder[0].requires_grad_(False)
    return quantize


def _bnb_nf4(linear: nn.Linear) -> nn.Module:
    import bitsandbytes as bnb

    dtype = linear.weight.dtype
    q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                          compute_dtype=dtype, quant_type="nf4", device="meta")
    q.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4")
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.data, requires_grad=False)
    # Params4bit quantizes when it is moved to a device; the weight's own device
    return q.to(linear.weight.device).requires_grad_(False)


_QUANTIZERS: dict[str, Callable[[nn.Linear], nn.Module]] = {
    "int8-quanto": _quanto("qint8"),
    "int4-quanto": _quanto("qint4"),
    "fp8-quanto": _quanto("qfloat8_e4m3fn"),
    "int8-torchao": _torchao("Int8WeightOnlyConfig"),
    "fp8-torchao": _torchao("Float8WeightOnlyConfig"),
    "nf4-bnb": _bnb_nf4,
    "fp8-torchao-dynamic": _torchao("Float8DynamicActivationFloat8WeightConfig"),
}


def _quantizable(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module) is nn.Linear and isinstance(weight, torch.Tensor) and weight.is_floating_point()
            and not weight.requires_grad and weight.device.type != "meta")


# ---------------------------------------------------------------------------- pages of a mapped file

def file_mapped_ranges() -> list[tuple[int, int]]:
    """(start, end) addresses of this process's private file mappings (Linux /proc/self/maps; [] elsewhere):
    where safetensors' memory-mapped tensors live."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split(maxsplit=5)
        # address perms offset dev inode path: a file (inode != 0, a path) mapped private ("p")
        if len(fields) == 6 and fields[4] != "0" and fields[1].endswith("p") and fields[5].startswith("/"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((start, end))
    return out


_libc = None


def release_file_pages(start: int, nbytes: int, mapped: list[tuple[int, int]]) -> int:
    """Hand back to the OS the whole pages of [start, start + nbytes) when they lie in one of the private file
    mappings `mapped` (file_mapped_ranges); returns the bytes released. A later read of those addresses would
    read the file again (the mapping is private, so only in-place edits of a dropped tensor are lost)."""
    global _libc
    if not sys.platform.startswith("linux") or nbytes <= 0:
        return 0
    if not any(lo <= start and start + nbytes <= hi for lo, hi in mapped):
        return 0
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, (start + nbytes) // page * page
    if last <= first:
        return 0
    if _libc is None:
        _libc = _load_libc()
    return last - first if _libc.madvise(first, last - first, mmap.MADV_DONTNEED) == 0 else 0


def trim_heap() -> None:
    """glibc's malloc_trim(0): return freed heap memory to the OS (a no-op where there is no glibc)."""
    global _libc
    if not sys.platform.startswith("linux"):
        return
    if _libc is None:
        _libc = _load_libc()
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def _load_libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


def quantize_frozen(model: nn.Module, value: str) -> int:
    """Replace every frozen `nn.Linear` of `model` by its `value` quantized layer, one at a time, in module order
    (block by block); returns how many. Each layer's full-precision weight is dropped as soon as its quantized
    layer takes its place, and when it was a view of a memory-mapped file (safetensors, read in the training
    dtype) its pages are handed back to the OS. Call after anything is merged into the weights and before a
    LoRA wraps the layers."""
    if value == NO_CHANGE:
        return 0
    quantize = _QUANTIZERS[value]
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    mapped = file_mapped_ranges()

    def replace(parent: nn.Module, name: str) -> None:
        child = parent._modules[name]
        weight = child.weight
        where = (weight.data_ptr(), weight.numel() * weight.element_size() if weight.is_contiguous() else 0)
        alive = weakref.ref(weight)
        parent._modules[name] = quantize(child)
        del child, weight
        if mapped and alive() is None:  # nothing else holds the float weight: its file pages can go
            if release_file_pages(*where, mapped):
                trim_heap()  # and the quantization's freed temporaries, which glibc keeps in its heap

    def walk(parent: nn.Module, path: tuple[str, ...]) -> int:
        count = 0
        for name in list(parent._modules):  # names only: no reference to a replaced layer outlives its turn
            child = parent._modules[name]
            if child is None or (keep and any(p in keep for p in (*path, name))):
                continue
            if _quantizable(child):
                del child
                replace(parent, name)
                count += 1
            else:
                count += walk(child, (*path, name))
        return count

    return walk(model, ())


def quantized_layers(modules: Iterable[nn.Module]) -> int:
    """How many layers of `modules` hold quantized weights (not plain floating tensors)."""
    return sum(1 for m in modules for sub in m.modules() if isinstance(sub, nn.Linear) and _is_quantized(sub.weight))


def _is_quantized(t: torch.Tensor) -> bool:
    return type(t) not in (torch.Tensor, nn.Parameter) or not t.is_floating_point()


# ---------------------------------------------------------------------------- sizes

def _tensor_bytes(t: torch.Tensor, seen: set) -> int:
    """Bytes a tensor holds: the storages of a wrapper subclass's inner tensors (torchao, quanto) and a
    bitsandbytes weight's quantization state (absmax, code)."""
    if id(t) in seen:
        return 0
    seen.add(id(t))
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None and type(t) not in (torch.Tensor, nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n), seen) for n in names)
    total = 0
    if t.device.type != "meta":
        storage = t.untyped_storage()
        # views of one storage (a fused BFL tensor split by rows, a GGUF file's blocks) count it once
        if ("storage", storage.data_ptr()) not in seen:
            seen.add(("storage", storage.data_ptr()))
            total = storage.nbytes()
    state = getattr(t, "quant_state", None)
    while state is not None:
        for v in vars(state).values():
            if isinstance(v, torch.Tensor):
                total += _tensor_bytes(v, seen)
        state = getattr(state, "state2", None)
    return total


def resident_bytes(module: nn.Module) -> int:
    """Bytes the weights and buffers of `module` hold, quantized tensors counted by what they store."""
    seen: set = set()
    return sum(_tensor_bytes(t, seen) for t in [*module.parameters(), *module.buffers()])
