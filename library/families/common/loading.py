"""Loading pieces every family shares: what a model path is (preset, diffusers folder, single file, cached hub id),
reading a single file's tensors with a one-line error naming what it holds instead, building a module from a
state dict, the SD-style autoencoder and CLIP tokenizers. Nothing is ever downloaded."""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, Callable, Mapping, Optional

import torch

from library.core.tensors import aligned
from library.families.base import Components, LoadOptions, ModelLoadError
from library.families.common import ldm_layout as ldm
from library.families.common.configs import text_encoder_config, vae_config
from library.families.common.dit_layout import strip_prefix
from library.families.common.empty_model import empty_model_for
from library.families.common.gguf_file import is_gguf, read_gguf
from library.families.common.tiny import build_seeded, build_tokenizer, tiny_vocab_size
from library.families.detect import describe_keys
from library.families.common.diffusers_import import diffusers_class

logger = logging.getLogger(__name__)

SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Tokenizers of the real models, looked for only locally (single files carry none).
_REFERENCE_TOKENIZERS = {False: ("openai/clip-vit-large-patch14", None),
                         True: ("stabilityai/stable-diffusion-2", "tokenizer")}


def classify_source(path: str, presets, what: str = "", folder_parts: tuple[str, ...] = (),
                    file_suffixes: Optional[tuple[str, ...]] = None, expected: str = "",
                    allow_hub: bool = False, gguf: bool = False) -> str:
    """What a model path is: "preset", "diffusers", "single_file" or (with allow_hub) "hub".

    `what` names the family in messages ("SDXL"), `folder_parts` are the subfolders its diffusers
    folder must have, `file_suffixes` the single-file names it takes (None: any file), `expected`
    what a missing path should have been. `gguf`: the family reads ComfyUI-GGUF files, so a GGUF file (by its
    magic, whatever its name) is a single file too. Anything else is a one-line ModelLoadError naming the problem.
    """
    if gguf and os.path.isfile(path) and is_gguf(path):
        return "single_file"
    family = f"{what} " if what else ""
    if path in presets:
        return "preset"
    if path.startswith(("tiny:", "random:")):
        raise ModelLoadError(f"--pretrained_model_name_or_path: unknown {family}preset {path!r}; "
                             f"expected one of {', '.join(presets)}")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "model_index.json")):
            raise ModelLoadError(f"{path}: not a diffusers model folder (no model_index.json)")
        missing = [p for p in folder_parts if not os.path.isdir(os.path.join(path, p))]
        if missing:
            raise ModelLoadError(f"{path}: not a diffusers {family}model (no {missing[0]}/ subfolder; expected "
                                 f"{', '.join(p + '/' for p in folder_parts)})")
        return "diffusers"
    if os.path.isfile(path):
        if file_suffixes and not path.lower().endswith(file_suffixes):
            raise ModelLoadError(f"{path}: expected a {' or '.join(file_suffixes)} {family}checkpoint or a "
                                 "diffusers folder")
        return "single_file"
    if allow_hub and _HUB_ID.match(path) and not path.lower().endswith(SINGLE_FILE_SUFFIXES):
        return "hub"
    raise ModelLoadError(f"--pretrained_model_name_or_path: {path} does not exist" +
                         (f" ({family}needs {expected})" if expected else ""))


def scratch_denoiser(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """--from_scratch: a new model of `model`'s class and config, its weights drawn after torch.manual_seed(seed)
    (the caller's RNG state is restored afterwards), in `model`'s dtype. The loaded weights are dropped."""
    fresh = build_seeded(lambda: type(model).from_config(model.config), seed)
    return fresh.to(dtype=model.dtype).eval()


# --- reading files ---------------------------------------------------------------

def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """All tensors of a `.safetensors` or torch-pickled (`.ckpt`) file; ModelLoadError if unreadable."""
    try:
        if path.lower().endswith(".safetensors"):
            from safetensors.torch import load_file

            data: Any = load_file(path)
        else:
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any reader failure is a bad file for the user
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"{path}: cannot read as a .safetensors/.ckpt checkpoint ({detail[:200]})") from None
    if isinstance(data, dict) and isinstance(data.get("state_dict"), dict):
        data = data["state_dict"]
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a dict of tensors, found {type(data).__name__}")
    return {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}


# --- configs from shapes ------------------------------------------------------------


def infer_vae_config(ckpt: Mapping[str, torch.Tensor], prefix: str = ldm.VAE_PREFIX) -> dict:
    """AutoencoderKL kwargs read from the shapes of LDM VAE tensors."""
    n_blocks = len({m[1] for k in ckpt if (m := re.match(re.escape(prefix) + r"encoder\.down\.(\d+)\.", k))})
    layers = len({m[1] for k in ckpt if (m := re.match(re.escape(prefix) + r"encoder\.down\.0\.block\.(\d+)\.", k))})
    channels = tuple(ckpt[f"{prefix}encoder.down.{i}.block.0.conv2.weight"].shape[0] for i in range(n_blocks))
    return vae_config(channels, layers_per_block=layers,
                      latent_channels=ckpt[prefix + "decoder.conv_in.weight"].shape[1])


def infer_text_encoder_config(ckpt: Mapping[str, torch.Tensor], v2: bool, tokenizer) -> dict:
    """CLIPTextConfig kwargs for SD1's CLIP-L or SD2's OpenCLIP-H (one layer fewer than stored)."""
    if v2:
        p = ldm.OPEN_CLIP_PREFIX
        tokens, positions = ckpt[p + "token_embedding.weight"], ckpt[p + "positional_embedding"]
        blocks = {m[1] for k in ckpt if (m := re.match(re.escape(p) + r"transformer\.resblocks\.(\d+)\.", k))}
        layers, intermediate = len(blocks) - 1, ckpt[p + "transformer.resblocks.0.mlp.c_fc.weight"].shape[0]
    else:
        p = ldm.CLIP_L_PREFIX + "text_model."
        tokens = ckpt[p + "embeddings.token_embedding.weight"]
        positions = ckpt[p + "embeddings.position_embedding.weight"]
        layers = len({m[1] for k in ckpt if (m := re.match(re.escape(p) + r"encoder\.layers\.(\d+)\.", k))})
        intermediate = ckpt[p + "encoder.layers.0.mlp.fc1.weight"].shape[0]
    return text_encoder_config(v2, hidden_size=tokens.shape[1], intermediate_size=intermediate,
                               num_hidden_layers=layers, vocab_size=tokens.shape[0],
                               max_position_embeddings=positions.shape[0], bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


# --- building models from state dicts ---------------------------------------------------

def materialize(factory, convert) -> torch.nn.Module:
    """Build a model without allocating weights, then adopt the converted tensors as its weights."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = factory()
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    model.load_state_dict(aligned(convert(shapes)), strict=True, assign=True)
    return model.eval()


def vae_from_ldm(checkpoint: Mapping[str, torch.Tensor], prefix: str):
    """An AutoencoderKL from LDM VAE tensors found under `prefix` ("first_stage_model." or "")."""
    AutoencoderKL = diffusers_class("AutoencoderKL")

    kwargs = infer_vae_config(checkpoint, prefix)
    return materialize(lambda: AutoencoderKL(**kwargs),
                        lambda s: ldm.pull(checkpoint, ldm.vae_key_map(s, prefix), s))


def find_tokenizer(v2: bool, vocab_size: int, tokenizer_cache_dir: Optional[str], path: str):
    """The tokenizer for a model without one: the local tiny one, or the real one from a local cache."""
    if vocab_size == tiny_vocab_size():
        return build_tokenizer(v2)
    from transformers import CLIPTokenizer

    repo, subfolder = _REFERENCE_TOKENIZERS[v2]
    attempts = []
    if tokenizer_cache_dir:
        # sd-scripts saves it as <cache_dir>/<repo with "/" -> "_">.
        local = os.path.join(tokenizer_cache_dir, repo.replace("/", "_"))
        if os.path.isdir(local):
            attempts.append((local, {}))
    attempts.append((repo, {"local_files_only": True, **({"subfolder": subfolder} if subfolder else {})}))
    for source, kwargs in attempts:
        try:
            tokenizer = CLIPTokenizer.from_pretrained(source, **kwargs)
        except Exception:  # not cached / unreadable: try the next place
            continue
        # transformers 5 returns an empty tokenizer instead of failing when files are missing.
        if len(tokenizer) == vocab_size:
            return tokenizer
    raise ModelLoadError(f"{path}: has no tokenizer and the {repo} tokenizer is not cached locally; "
                             f"pass --tokenizer_cache_dir with a saved copy of it "
                             f"(folder {repo.replace('/', '_')}) or use a diffusers folder")


def load_folder_parts(folder: str, classes: dict, what: str, scratch: Optional[tuple[str, int]] = None) -> dict:
    """{part: cls.from_pretrained(folder, subfolder=part)} for `classes` {part: cls}; models in eval mode.

    Every subfolder is checked first, and any loading failure becomes one ModelLoadError line naming `what`.
    `scratch` = (part, seed), --from_scratch: that part is built from its config.json with weights drawn
    from the seed (scratch_denoiser), its weight files are not read.
    """
    for part in classes:
        if not os.path.isdir(os.path.join(folder, part)):
            raise ModelLoadError(f"{folder}: {what} diffusers folder has no {part}/ subfolder")

    def load(part: str, cls):
        if scratch and part == scratch[0]:
            config = cls.load_config(folder, subfolder=part)
            return build_seeded(lambda: cls.from_config(config), scratch[1])
        return cls.from_pretrained(folder, subfolder=part)

    try:
        parts = {part: load(part, cls) for part, cls in classes.items()}
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelLoadError(f"{folder}: cannot load the {what} diffusers model "
                             f"({str(e).strip().splitlines()[0][:200]})") from None
    for part in parts.values():
        if isinstance(part, torch.nn.Module):
            part.eval()
    return parts


def cached_hub_folder(repo_id: str) -> str:
    """The local snapshot of a hub model, never downloading; ModelLoadError when not cached."""
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(repo_id, local_files_only=True)
    except Exception:
        folder = None
    if not folder or not os.path.isfile(os.path.join(folder, "model_index.json")):
        raise ModelLoadError(f"cannot reach the Hugging Face hub for '{repo_id}': download the model and pass "
                             "a local path (a diffusers folder or a .safetensors/.ckpt file)")
    return folder


def load_vae(path: str):
    """--vae: a diffusers VAE folder (or a model folder with vae/), or a single file of VAE tensors."""
    AutoencoderKL = diffusers_class("AutoencoderKL")

    if os.path.isdir(path):
        sub = "vae" if os.path.isdir(os.path.join(path, "vae")) else None
        try:
            return AutoencoderKL.from_pretrained(path, subfolder=sub).eval()
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"--vae {path}: not a diffusers VAE folder ({str(e).splitlines()[0][:200]})") from None
    if not os.path.isfile(path):
        raise ModelLoadError(f"--vae: {path} does not exist")
    checkpoint = read_checkpoint(path)
    for prefix in (ldm.VAE_PREFIX, ""):
        if prefix + "encoder.conv_in.weight" in checkpoint and prefix + "decoder.conv_in.weight" in checkpoint:
            try:
                return vae_from_ldm(checkpoint, prefix)
            except (ldm.LayoutError, ValueError) as e:
                raise ModelLoadError(f"--vae {path}: VAE tensors are incomplete or mis-shaped ({e})") from None
    sample = ", ".join(list(checkpoint)[:3]) or "no tensors"
    raise ModelLoadError(f"--vae {path}: expected VAE keys (encoder.*, decoder.*, optionally under "
                         f"first_stage_model.), found {sample}")


def read_file(label: str, path: str, expected: str, holds: Callable[[list[str]], bool],
               dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of one .safetensors file, floating ones cast to `dtype` as they are read.

    `holds(keys)` checks the header first, so a file of the wrong kind stops before any
    weight is read, with a message naming what the file holds instead.
    """
    from safetensors import safe_open


    if not os.path.isfile(path):
        raise ModelLoadError(f"{label}: {path} does not exist")
    if not path.lower().endswith(".safetensors"):
        raise ModelLoadError(f"{label} {path}: expected a .safetensors file")
    try:
        with safe_open(path, "pt") as f:
            keys = list(f.keys())
            if not holds(keys):
                raise ModelLoadError(f"{label} {path}: expected {expected}, found {describe_keys(keys)}")
            tensors = {}
            for key in keys:
                tensor = f.get_tensor(key)
                # float8 stays as read until upcast_float8 can apply ComfyUI's scale_weight to it
                if tensor.is_floating_point() and tensor.dtype not in FLOAT8_DTYPES:
                    tensor = tensor.to(dtype)
                tensors[key] = tensor
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - any reader failure is a bad file for the user
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"{label} {path}: cannot read as .safetensors ({detail[:200]})") from None
    return upcast_float8(tensors, dtype)


def adopt(label: str, path: str, factory, state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Build a model without allocating weights, then take `state_dict`'s tensors as its weights."""
    model, wanted = empty_model_for(label, path, factory, state_dict)
    model.load_state_dict(aligned({k: state_dict[k] for k in wanted}), strict=True, assign=True)
    return model.eval()


FLOAT8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                      if hasattr(torch, n))


def upcast_float8(checkpoint: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """float8 tensors as `dtype`; ComfyUI's scaled-fp8 weights are multiplied by their `scale_weight`.

    Other tensors are returned as they are; the marker keys (`scaled_fp8`, `*.scale_weight`,
    `*.scale_input`) are dropped.
    """
    out = {}
    for key, tensor in checkpoint.items():
        if key == "scaled_fp8" or key.endswith((".scale_weight", ".scale_input")):
            continue
        if tensor.dtype in FLOAT8_DTYPES:
            scale = checkpoint.get(key[:-len("weight")] + "scale_weight") if key.endswith(".weight") else None
            tensor = tensor.to(dtype) if scale is None else (tensor.float() * scale.float()).to(dtype)
        out[key] = tensor
    return out


def cached_tokenizer(repo: str, tokenizer_cache_dir: Optional[str], accept: Callable[[Any], bool] = lambda t: True):
    """`repo`'s tokenizer from --tokenizer_cache_dir (its folder `<owner>_<name>`) or the local Hugging Face cache,
    the first that loads and that `accept` takes; None when neither has it (nothing is downloaded)."""
    from transformers import AutoTokenizer

    sources = [os.path.join(tokenizer_cache_dir, repo.replace("/", "_"))] if tokenizer_cache_dir else []
    for source in sources + [repo]:
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        except Exception:  # noqa: BLE001 - not cached / unreadable: try the next place
            continue
        if accept(tokenizer):
            return tokenizer
    return None


# --- the single-file DiT families (FLUX.2, Z-Image, Lumina, HunyuanImage) ----------------------------------------

def read_dit_file(label: str, path: str, dtype: torch.dtype, *, expected: str, marker: "re.Pattern[str]",
                  infer_shape: Callable[[dict[str, torch.Tensor]], dict], what: str,
                  gguf_archs: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """(tensors, shape) of an original DiT file: its tensors without ComfyUI's `model.diffusion_model.` prefix and
    `infer_shape` of them. A header with no key `marker` matches stops as "expected `expected`"; a tensor
    `infer_shape` needs and the file lacks as "incomplete `what`" (one-line ModelLoadErrors). With `gguf_archs`, a
    ComfyUI-GGUF file of one of those architectures is read too (quantized tensors kept: gguf_file.read_gguf)."""
    holds = lambda keys: any(marker.match(k) for k in keys)  # noqa: E731
    if gguf_archs and is_gguf(path):
        tensors = strip_prefix(read_gguf(label, path, expected, holds, dtype, archs=gguf_archs))
    else:
        tensors = strip_prefix(read_file(label, path, expected, holds, dtype))
    try:
        return tensors, infer_shape(tensors)
    except KeyError as e:
        raise ModelLoadError(f"{label} {path}: incomplete {what}, no tensor for {e.args[0]}") from None


def finish_components(opts: LoadOptions, denoiser: torch.nn.Module, text_encoders: list, tokenizers: list, vae,
                      vae_path: Optional[str], *, scratch_done: bool = False) -> Components:
    """The loaded parts as Components: --from_scratch's fresh denoiser (unless the folder loader drew it already),
    the denoiser and text encoders in opts.dtype and the VAE (None: not loaded) in opts.vae_dtype."""
    if opts.from_scratch and not scratch_done:
        denoiser = scratch_denoiser(denoiser, opts.init_seed)
    for module, dtype in ((denoiser, opts.dtype), *((te, opts.dtype) for te in text_encoders), (vae, opts.vae_dtype)):
        if module is not None and next(module.parameters()).dtype != dtype:
            module.to(dtype=dtype)
    return Components(denoiser=denoiser, vae=vae, text_encoders=list(text_encoders), tokenizers=list(tokenizers),
                      model_path=opts.pretrained_model_name_or_path, vae_path=vae_path)


def part_config(folder: str, part: str) -> dict:
    """The config.json of a diffusers folder's `part`/ (OSError / ValueError when it is missing or unreadable)."""
    with open(os.path.join(folder, part, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def load_dit_parts(opts: LoadOptions, kind: str, ae_path: Optional[str], *,
                   dit_file: Callable[[str, torch.dtype], torch.nn.Module],
                   text_file: Optional[Callable[[], tuple]],
                   ae_file: Callable[[str, torch.dtype], torch.nn.Module],
                   preset: Callable[[str], dict],
                   folder: Optional[Callable[[str, Optional[int]], dict]] = None) -> tuple[dict, bool]:
    """({"transformer", "text_encoder", "tokenizer", "vae"}, whether --from_scratch's weights are drawn already) of a
    family loaded from a DiT file, a diffusers folder or a preset (`kind`, from classify_source).

    A DiT file (`dit_file(path, dtype)`) takes its text encoder from `text_file()` -> (encoder, tokenizer), which
    the family has checked is given, and its AE from `ae_file(ae_path, vae_dtype)` (none without one: the LoRA
    tools need no AE). A folder (`folder(path, scratch seed or None)`) or a preset (`preset(name)`) brings all four,
    its text encoder replaced by `text_file()` where given (not None) and its AE by the file at `ae_path`."""
    path = opts.pretrained_model_name_or_path
    if kind == "single_file":
        transformer = dit_file(path, opts.dtype)
        text_encoder, tokenizer = text_file()
        vae = ae_file(ae_path, opts.vae_dtype) if ae_path else None
        return {"transformer": transformer, "text_encoder": text_encoder, "tokenizer": tokenizer, "vae": vae}, False
    scratch_done = False
    if kind == "diffusers":
        parts = folder(path, opts.init_seed if opts.from_scratch else None)
        scratch_done = opts.from_scratch
    else:
        parts = preset(path)
    parts = {k: parts[k] for k in ("transformer", "text_encoder", "tokenizer", "vae")}
    if text_file is not None:
        parts["text_encoder"], parts["tokenizer"] = text_file()
    if ae_path:
        parts["vae"] = ae_file(ae_path, opts.vae_dtype)
    return parts, scratch_done
