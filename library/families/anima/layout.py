"""Anima's original single-file layout (the `net.*` keys ComfyUI and sd-scripts load) and the module names in it.

The file holds the Cosmos-Predict2 DiT under its MiniTrainDIT names (`blocks.N.self_attn.q_proj`,
`x_embedder.proj.1`, `final_layer.linear`, ...) and the LLM adapter under `llm_adapter.*`, all under
`net.`. Here the DiT is diffusers' CosmosTransformer3DModel (`transformer.*` inside AnimaDiT) and the
adapter diffusers' AnimaTextConditioner (`llm_adapter.*`, the same names as the file). Loading goes
through diffusers' own Cosmos converter; saving and the kohya LoRA names use `original_path`, its inverse.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

NET_PREFIX = "net."
ADAPTER_PREFIX = "llm_adapter."
# The key whose presence says a DiT file carries the LLM adapter (sd-scripts' test).
ADAPTER_MARKER = "llm_adapter.out_proj.weight"
# Key names a DiT file may carry that no module holds: the RoPE tables MiniTrainDIT keeps as persistent buffers
# and training counters of NVIDIA's checkpoints.
IGNORED_KEYS = re.compile(r"(^|\.)(pos_embedder\.(seq|dim_spatial_range|dim_temporal_range)|accum_\w+|_extra_state)$")

# diffusers path inside CosmosTransformer3DModel -> MiniTrainDIT path, applied in order to whole dotted parts.
_BLOCK_PARTS = (
    (r"norm1\.linear_(\d)", lambda m: f"adaln_modulation_self_attn.{m[1]}"),
    (r"norm2\.linear_(\d)", lambda m: f"adaln_modulation_cross_attn.{m[1]}"),
    (r"norm3\.linear_(\d)", lambda m: f"adaln_modulation_mlp.{m[1]}"),
    (r"attn1\.", lambda m: "self_attn."),
    (r"attn2\.", lambda m: "cross_attn."),
    (r"to_q\b", lambda m: "q_proj"), (r"to_k\b", lambda m: "k_proj"), (r"to_v\b", lambda m: "v_proj"),
    (r"to_out\.0\b", lambda m: "output_proj"), (r"norm_q\b", lambda m: "q_norm"), (r"norm_k\b", lambda m: "k_norm"),
    (r"ff\.net\.0\.proj\b", lambda m: "mlp.layer1"), (r"ff\.net\.2\b", lambda m: "mlp.layer2"),
)
_OUTSIDE = (
    ("patch_embed.proj", "x_embedder.proj.1"),
    ("time_embed.t_embedder.", "t_embedder.1."),
    ("time_embed.norm", "t_embedding_norm"),
    ("norm_out.linear_", "final_layer.adaln_modulation."),
    ("proj_out", "final_layer.linear"),
)


def transformer_original_path(path: str) -> str:
    """A CosmosTransformer3DModel module/parameter path -> its MiniTrainDIT name (`transformer_blocks.3.attn1.to_q`
    -> `blocks.3.self_attn.q_proj`)."""
    block = re.match(r"transformer_blocks\.(\d+)(\.|$)(.*)", path)
    if block:
        rest = block[3]
        for pattern, repl in _BLOCK_PARTS:
            rest = re.sub(pattern, repl, rest)
        return f"blocks.{block[1]}" + (f".{rest}" if rest else "")
    for old, new in _OUTSIDE:
        if path.startswith(old):
            return new + path[len(old):]
    return path


def original_path(path: str) -> str:
    """A path inside AnimaDiT -> its name in the original file (without `net.`): the DiT's MiniTrainDIT names,
    the adapter's as they are."""
    if path.startswith("transformer."):
        return transformer_original_path(path[len("transformer."):])
    return path


def rope_buffers(config) -> dict[str, torch.Tensor]:
    """The RoPE tables MiniTrainDIT saves as persistent buffers (`pos_embedder.seq`, ...), as sd-scripts' saves
    hold them; computed from the config (diffusers builds them on the fly)."""
    head_dim = int(config.attention_head_dim)
    patch = config.patch_size
    longest = max(size // p for size, p in zip(config.max_size, patch))
    dim_h = head_dim // 6 * 2
    dim_t = head_dim - 2 * dim_h
    return {"pos_embedder.seq": torch.arange(longest, dtype=torch.float32),
            "pos_embedder.dim_spatial_range": torch.arange(0, dim_h, 2)[: dim_h // 2].float() / dim_h,
            "pos_embedder.dim_temporal_range": torch.arange(0, dim_t, 2)[: dim_t // 2].float() / dim_t}


def original_tensors(dit: torch.nn.Module, with_adapter: bool = True) -> dict[str, torch.Tensor]:
    """The model's own tensors (not copies) under the original file's names, `net.` prefixed, as sd-scripts'
    anima_train.py saves them (RoPE buffers included)."""
    out = {NET_PREFIX + original_path("transformer." + k): v for k, v in dit.transformer.state_dict().items()}
    out.update({NET_PREFIX + k: v for k, v in rope_buffers(dit.transformer.config).items()})
    if with_adapter:
        out.update({NET_PREFIX + ADAPTER_PREFIX + k: v for k, v in dit.llm_adapter.state_dict().items()})
    return out


def split_original(tensors: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
    """(DiT tensors, adapter tensors) of an original file, `net.` and ComfyUI's `model.diffusion_model.` dropped
    and the keys no module holds left out (a whole-model file's text encoder and VAE keys are not DiT keys:
    loading takes only the DiT's own)."""
    dit, adapter = {}, {}
    for key, value in tensors.items():
        for prefix in ("model.diffusion_model.", NET_PREFIX):  # ComfyUI's whole-model files have both
            if key.startswith(prefix):
                key = key[len(prefix):]
        if IGNORED_KEYS.search(key):
            continue
        if key.startswith(ADAPTER_PREFIX):
            adapter[key[len(ADAPTER_PREFIX):]] = value
        else:
            dit[key] = value
    return dit, adapter


def to_diffusers(dit_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MiniTrainDIT tensors -> CosmosTransformer3DModel names, by diffusers' own Cosmos-Predict2 converter."""
    from diffusers.loaders.single_file_utils import convert_cosmos_transformer_checkpoint_to_diffusers

    return convert_cosmos_transformer_checkpoint_to_diffusers(dict(dit_tensors))


def infer_transformer_shape(dit_tensors: Mapping[str, torch.Tensor]) -> dict:
    """Blocks, heads, head width, AdaLN-LoRA width and text width of a MiniTrainDIT state dict (no prefix)."""
    blocks = len({m[1] for k in dit_tensors if (m := re.match(r"blocks\.(\d+)\.", k))})
    hidden = dit_tensors["x_embedder.proj.1.weight"].shape[0]
    head_dim = dit_tensors["blocks.0.self_attn.q_norm.weight"].shape[0]
    return dict(blocks=blocks, heads=hidden // head_dim, head_dim=head_dim,
                adaln_lora_dim=dit_tensors["blocks.0.adaln_modulation_self_attn.1.weight"].shape[0],
                text_dim=dit_tensors["blocks.0.cross_attn.k_proj.weight"].shape[1],
                in_channels=dit_tensors["x_embedder.proj.1.weight"].shape[1] // 4 - 1)


def infer_adapter_shape(adapter_tensors: Mapping[str, torch.Tensor]) -> dict:
    """Layers, width, heads (from the per-head q_norm), source width and T5 vocabulary of an LLM adapter state dict."""
    layers = len({m[1] for k in adapter_tensors if (m := re.match(r"blocks\.(\d+)\.", k))})
    vocab, width = adapter_tensors["embed.weight"].shape
    head_dim = adapter_tensors["blocks.0.cross_attn.q_norm.weight"].shape[0]
    return dict(layers=layers, width=width, heads=width // head_dim, vocab=vocab,
                source_dim=adapter_tensors["blocks.0.cross_attn.k_proj.weight"].shape[1])
