"""GGUF base files as ComfyUI users have them (city96's ComfyUI-GGUF layout), read by the `gguf` library and kept
quantized by diffusers' GGUF pieces (`GGUFParameter`, `GGUFLinear`, `dequantize_gguf_tensor`).

A ComfyUI-GGUF transformer file holds the original (BFL / ComfyUI) keys, e.g. FLUX.1's
`double_blocks.0.img_attn.qkv.weight`, optionally under `model.diffusion_model.`, and names its model in
`general.architecture` ("flux", "qwen_image", "lumina2" for Z-Image, ...). Its 2-D weights are Q8_0 / Q4_K / Q5_K /
Q4_0 / ... blocks of bytes; 1-D tensors and the embedders / final layer stay F32 / F16 (city96's convert.py). Here:

- F32 / F16 / BF16 tensors are read (not mapped) into ordinary tensors in the training dtype;
- quantized tensors stay as they are in the file (a memory-mapped view; pages are read when a layer first computes)
  as diffusers' `GGUFParameter`, whose shape is the byte shape (rows, bytes per row); `logical_shape` gives the
  shape of the weight it holds, read from the GGUF tensor info (config inference must use it);
- `adopt_gguf` builds the model on the meta device, puts a `GgufLinear` (diffusers' `GGUFLinear`, dequantizing per
  forward with diffusers' torch dequantization) wherever a Linear's weight is quantized, and adopts the tensors.

The weights are frozen: only a LoRA on those layers trains (in the training dtype). No kernel is ours.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Callable, Iterable, Mapping, Optional

import torch
from torch import nn

from library.core.tensors import aligned
from library.families.base import ModelLoadError
from library.families.common.empty_model import empty_model_for
from library.families.detect import describe_keys

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
PREFIX = "model.diffusion_model."  # ComfyUI's all-in-one prefix, stripped as ComfyUI-GGUF's loader does
# city96's convert.py keeps these weights (and every 1-D tensor) in full precision
FULL_PRECISION_KEYS = ("time_embedding.", "add_embedding.", "time_in.", "txt_in.", "vector_in.", "img_in.",
                       "guidance_in.", "final_layer.")


def is_gguf(path: str) -> bool:
    """Whether `path` is a GGUF file: its name ends in .gguf or it starts with the GGUF magic."""
    if path.lower().endswith(GGUF_SUFFIX):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def logical_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape of the weight a tensor holds: a GGUF-quantized tensor's logical shape (its `quant_shape`, from the
    GGUF block size), not its byte shape; any other tensor's shape."""
    return tuple(getattr(tensor, "quant_shape", None) or tensor.shape)


def is_quantized(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "quant_type") and getattr(tensor, "quant_shape", None) is not None


def supported_types() -> list[str]:
    """The GGUF tensor types this loader reads: F32 / F16 and what diffusers dequantizes."""
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES

    return ["F32", "F16", *(t.name for t in SUPPORTED_GGUF_QUANT_TYPES)]


def gguf_missing() -> Optional[str]:
    """Why GGUF files cannot be read here (the gguf package is not installed), or None."""
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        return "reading a GGUF file needs the gguf package, which is not installed (pip install gguf)"
    return None


def _reader(label: str, path: str):
    missing = gguf_missing()
    if missing:
        raise ModelLoadError(f"{label} {path}: {missing}")
    import gguf

    if not os.path.isfile(path):
        raise ModelLoadError(f"{label}: {path} does not exist")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ModelLoadError(f"{label} {path}: not a GGUF file (it does not start with the GGUF magic)")
        return gguf.GGUFReader(path, "c")  # copy-on-write mapping: writable views, nothing read until touched
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - any reader failure is a bad file for the user
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"{label} {path}: cannot read as GGUF ({detail[:200]})") from None


def architecture(reader) -> Optional[str]:
    field = reader.get_field("general.architecture")
    if field is None:
        return None
    try:
        return str(field.contents())
    except Exception:  # noqa: BLE001 - a malformed field: treated as absent
        return None


def _names(reader) -> list[str]:
    names = [t.name for t in reader.tensors]
    if any(n.startswith(PREFIX) for n in names):
        return [n[len(PREFIX):] for n in names if n.startswith(PREFIX)]
    return names


def gguf_keys(path: str) -> list[str]:
    """The tensor names of a GGUF file (prefix stripped), read from its header only."""
    return _names(_reader("--pretrained_model_name_or_path", path))


def _orig_shape(reader, name: str) -> Optional[tuple[int, ...]]:
    """ComfyUI-GGUF's `comfy.gguf.orig_shape.<name>` (tensors it reshaped when writing), or None."""
    field = reader.get_field(f"comfy.gguf.orig_shape.{name}")
    if field is None:
        return None
    return tuple(int(field.parts[i][0]) for i in field.data)


def read_gguf(label: str, path: str, expected: str, holds: Callable[[list[str]], bool], dtype: torch.dtype,
              archs: Iterable[str]) -> dict[str, torch.Tensor]:
    """The tensors of a ComfyUI-GGUF transformer file: F32 / F16 / BF16 ones in `dtype`, quantized ones as
    diffusers' GGUFParameter over the file's mapped bytes.

    Checked first, from the header, each a one-line ModelLoadError: the GGUF magic, `general.architecture`
    (one of `archs`; absent is accepted, as ComfyUI-GGUF reads sd.cpp files), the tensor names (`holds`) and
    every tensor type (those diffusers cannot dequantize are named)."""
    import gguf
    from diffusers.quantizers.gguf.utils import GGUFParameter, SUPPORTED_GGUF_QUANT_TYPES

    reader = _reader(label, path)
    archs = tuple(archs)
    arch = architecture(reader)
    if arch is not None and arch not in archs:
        raise ModelLoadError(f"{label} {path}: a GGUF file of architecture {arch!r}; expected {expected} "
                             f"(general.architecture {' or '.join(repr(a) for a in archs)})")
    keys = _names(reader)
    if not holds(keys):
        raise ModelLoadError(f"{label} {path}: expected {expected}, found {describe_keys(keys)}")
    plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    unsupported = sorted({t.tensor_type.name for t in reader.tensors
                          if t.tensor_type not in plain and t.tensor_type not in SUPPORTED_GGUF_QUANT_TYPES})
    if unsupported:
        raise ModelLoadError(f"{label} {path}: GGUF tensor type {', '.join(unsupported)} is not supported "
                             f"(diffusers dequantizes {', '.join(supported_types())})")
    prefixed = any(t.name.startswith(PREFIX) for t in reader.tensors)
    floats = {gguf.GGMLQuantizationType.F32: torch.float32, gguf.GGMLQuantizationType.F16: torch.float16,
              gguf.GGMLQuantizationType.BF16: torch.bfloat16}
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb") as f:
        for t in reader.tensors:
            if prefixed and not t.name.startswith(PREFIX):
                continue
            key = t.name[len(PREFIX):] if prefixed else t.name
            shape = _orig_shape(reader, t.name) or tuple(int(n) for n in reversed(t.shape))
            if t.tensor_type in floats:
                # read, not mapped: the file's float pages are not kept resident beside the training-dtype copy
                if not int(t.n_bytes):  # an empty marker (ComfyUI's __index_timestep_zero__ in Edit-2511 files)
                    out[key] = torch.empty(shape, dtype=dtype)
                    continue
                buf = bytearray(int(t.n_bytes))
                f.seek(int(t.data_offset))
                f.readinto(buf)
                out[key] = torch.frombuffer(buf, dtype=floats[t.tensor_type]).reshape(shape).to(dtype)
                continue
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                tensor = GGUFParameter(torch.from_numpy(t.data), quant_type=t.tensor_type)  # mapped, read when used
            if tuple(tensor.quant_shape) != shape:  # a tensor ComfyUI-GGUF reshaped: dequantized in its shape
                tensor = _dequantized(tensor).reshape(shape).to(dtype)
            out[key] = tensor
    return out


def _dequantized(tensor: torch.Tensor) -> torch.Tensor:
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    return dequantize_gguf_tensor(tensor)


def gguf_linear_class():
    """GgufLinear: diffusers' GGUFLinear computing in the input's dtype (the training dtype, or what autocast
    makes of it), so the base follows the trainer's casts; its weight stays quantized and is dequantized by
    diffusers' torch functions for every forward. For backward only the quantized weight is kept (a view of the
    file) and dequantized again: a plain `linear` on the dequantized weight would keep every layer's
    full-precision copy alive from the forward to the backward, the whole model's worth without checkpointing."""
    global _GgufLinear
    if _GgufLinear is None:
        from diffusers.quantizers.gguf.utils import GGUFLinear, dequantize_gguf_tensor

        class _Matmul(torch.autograd.Function):
            @staticmethod
            def forward(ctx, inputs, qweight, bias):
                ctx.save_for_backward(qweight)
                weight = dequantize_gguf_tensor(qweight).to(inputs.dtype)
                return nn.functional.linear(inputs, weight, None if bias is None else bias.to(inputs.dtype))

            @staticmethod
            def backward(ctx, grad):
                (qweight,) = ctx.saved_tensors
                grad_input = grad_bias = None
                if ctx.needs_input_grad[0]:
                    grad_input = grad @ dequantize_gguf_tensor(qweight).to(grad.dtype)
                if ctx.needs_input_grad[2]:
                    grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
                return grad_input, None, grad_bias

        class GgufLinear(GGUFLinear):
            def forward(self, inputs: torch.Tensor) -> torch.Tensor:
                return _Matmul.apply(inputs, self.weight, self.bias)

        _GgufLinear = GgufLinear
    return _GgufLinear


_GgufLinear = None


def adopt_gguf(label: str, path: str, factory, state_dict: Mapping[str, torch.Tensor]) -> nn.Module:
    """Build a model without allocating weights and take `state_dict`'s tensors as its weights, every Linear whose
    weight is GGUF-quantized becoming a GgufLinear that keeps it so (frozen). A quantized weight of any other
    layer is dequantized into the training dtype. Shapes are checked by their logical shape."""
    from accelerate import init_empty_weights

    model, wanted = empty_model_for(label, path, factory, state_dict, shape_of=logical_shape)
    linear_cls = gguf_linear_class()
    dtype = next((v.dtype for v in state_dict.values() if v.is_floating_point() and not is_quantized(v)),
                 torch.float32)
    kept: dict[str, torch.Tensor] = {}
    for name, module in list(model.named_modules()):
        key = f"{name}.weight"
        if type(module) is nn.Linear and key in state_dict and is_quantized(state_dict[key]):
            parent, _, child = name.rpartition(".")
            with init_empty_weights(include_buffers=False):
                layer = linear_cls(module.in_features, module.out_features, module.bias is not None,
                                   compute_dtype=dtype)
            model.get_submodule(parent)._modules[child] = layer
            kept[key] = state_dict[key]
    rest = {k: (_dequantized(state_dict[k]).reshape(wanted[k]).to(dtype) if is_quantized(state_dict[k])
                else state_dict[k]) for k in wanted if k not in kept}
    result = model.load_state_dict(aligned(rest), strict=False, assign=True)
    assert not result.unexpected_keys and set(result.missing_keys) == set(kept), result
    for key, tensor in kept.items():
        owner, _, param = key.rpartition(".")
        model.get_submodule(owner)._parameters[param] = tensor  # a GGUFParameter (requires_grad False)
    return model.eval()


# --- writing (tests, bench; the layout of city96's convert.py) ------------------------------------------------

def write_gguf(path: str, tensors: Mapping[str, torch.Tensor], qtype: str, arch: str,
               full_precision: Iterable[str] = FULL_PRECISION_KEYS) -> dict[str, str]:
    """Write `tensors` (original-layout keys) as a ComfyUI-GGUF file: 2-D weights quantized to `qtype` ("Q8_0",
    "Q4_0", "Q5_0", ...; what gguf.quants can write), 1-D tensors and the embedder / final-layer weights F32, as
    city96's convert.py does (`full_precision`: the key parts kept F32; () quantizes every 2-D weight, as other
    converters do); a row length the block size does not divide stays F32. Written to a temporary file and
    renamed. Returns {key: type name}."""
    import gguf
    import numpy as np

    target = getattr(gguf.GGMLQuantizationType, qtype)
    full_precision = tuple(full_precision)
    types: dict[str, str] = {}
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".gguf-", dir=folder)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, arch=arch)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{qtype}", gguf.LlamaFileType.ALL_F32))
        for key, tensor in tensors.items():
            data = tensor.detach().float().numpy() if tensor.dtype == torch.bfloat16 else tensor.detach().numpy()
            data = np.ascontiguousarray(data.astype(np.float32))
            kind = target
            if data.ndim <= 1 or (any(k in key for k in full_precision) and ".weight" in key):
                kind = gguf.GGMLQuantizationType.F32
            try:
                packed = gguf.quants.quantize(data, kind)
            except (gguf.QuantError, NotImplementedError, AttributeError):
                kind = gguf.GGMLQuantizationType.F32
                packed = gguf.quants.quantize(data, kind)
            writer.add_tensor(key, packed, raw_dtype=kind)
            types[key] = kind.name
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return types


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
