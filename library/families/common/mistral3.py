"""The Mistral-Small-3.1 text encoder of FLUX.2 [dev] (transformers Mistral3ForConditionalGeneration, text path
only): its config at given sizes, and loading it (`--mistral3`) from a transformers folder or a .safetensors file
(the FLUX.2-dev repository's text_encoder/ shards, the first one named, or one merged file), keeping the language
model (MistralModel: the text path of Mistral3 gives the same hidden states; the vision tower, projector and LM head
are not used), with its processor: the family's tiny one for the tiny encoder, else the real one from
--tokenizer_cache_dir or the local Hugging Face cache (never a download).

Keys are accepted in transformers' current layout (`model.language_model.*`), the older one
(`language_model.model.*`), ComfyUI's (`model.*`) or bare (`layers.*`); vision and projector keys are skipped.
Mistral-Small-3.1's head width (128) is not the hidden size / heads (5120 / 32 = 160): the head counts are read from
the projection shapes at that width.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Callable, Optional

import torch

from library.families.base import ModelLoadError
from library.families.common.loading import adopt, read_file

HEAD_DIM = 128  # Mistral-Small-3.1's attention head width (text_config.head_dim)
TOKENIZER_REPO = "mistralai/Mistral-Small-3.1-24B-Instruct-2503"  # the processor BFL's and musubi-tuner's code use
_MARKER = re.compile(r"(^|\.)layers\.0\.self_attn\.k_proj\.weight$")
_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_SKIP = ("vision_tower.", "multi_modal_projector.", "lm_head.", "model.vision_tower.", "model.multi_modal_projector.",
         "language_model.lm_head.")
_SHARD = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.safetensors$")


def mistral_text_config(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
                        head_dim: int = HEAD_DIM):
    """transformers.MistralConfig of Mistral-Small-3.1's text model (rope θ 1e9, eps 1e-5, no sliding window) at the
    given sizes."""
    from transformers import MistralConfig

    return MistralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5,
                         rope_theta=1000000000.0, sliding_window=None, tie_word_embeddings=False, use_cache=False)


def shard_paths(path: str) -> list[str]:
    """`path` and, for a shard `name-00001-of-00010.safetensors`, every sibling shard (all must exist)."""
    m = _SHARD.match(os.path.basename(path))
    if not m:
        return [path]
    folder = os.path.dirname(path)
    total = int(m[3])
    paths = [os.path.join(folder, f"{m[1]}-{i:05d}-of-{m[3]}.safetensors") for i in range(1, total + 1)]
    absent = [p for p in paths if not os.path.isfile(p)]
    if absent:
        raise ModelLoadError(f"--mistral3 {path}: shard {os.path.basename(absent[0])} of {total} is missing beside it")
    return paths


def header_keys(label: str, path: str) -> list[str]:
    """The tensor names of a .safetensors file (its header only)."""
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            return list(f.keys())
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelLoadError(f"{label} {path}: not a readable .safetensors file ({str(e).splitlines()[0][:200]})") \
            from None


def text_tensors(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MistralModel keys (`embed_tokens.*`, `layers.*`, `norm.*`) of a Mistral3 / Mistral state dict in any of the
    accepted layouts."""
    out = {}
    for key, value in raw.items():
        if key.startswith(_SKIP):
            continue
        for prefix in _PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix):]
                break
        if key.startswith(("embed_tokens.", "layers.", "norm.")):
            out[key] = value
    return out


def load_mistral3(path: str, dtype: torch.dtype, tokenizer_cache_dir: Optional[str],
                  tiny_processor: Callable[[], object], tiny_vocab: int):
    """(MistralModel, processor) from --mistral3 `path` (a folder of Mistral3ForConditionalGeneration, or a file /
    first shard); `tiny_processor` builds the family's tiny processor, used when the vocabulary is `tiny_vocab`."""
    from transformers import AutoProcessor, MistralModel

    label = "--mistral3"
    if os.path.isdir(path):
        from transformers import Mistral3ForConditionalGeneration

        try:
            full = Mistral3ForConditionalGeneration.from_pretrained(path, torch_dtype=dtype)
            processor = AutoProcessor.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{label} {path}: not a Mistral3 folder ({str(e).splitlines()[0][:200]})") from None
        return language_model(full), processor
    expected = "a Mistral-Small-3.1 text encoder (layers.*.self_attn.k_proj keys)"
    shards = shard_paths(path)
    if len(shards) > 1:  # the marker may sit in any shard: checked over all their headers before any weight
        keys = [k for shard in shards for k in header_keys(label, shard)]
        if not any(_MARKER.search(k) for k in keys):
            raise ModelLoadError(f"{label} {path}: expected {expected}, found none in its {len(shards)} shards")
    raw: dict[str, torch.Tensor] = {}
    for shard in shards:
        raw.update(read_file(label, shard, expected,
                             lambda keys: len(shards) > 1 or any(_MARKER.search(k) for k in keys), dtype))
    tensors = text_tensors(raw)
    try:
        vocab, hidden = tensors["embed_tokens.weight"].shape
        config = mistral_text_config(
            hidden=hidden, intermediate=tensors["layers.0.mlp.gate_proj.weight"].shape[0],
            layers=len({m[1] for key in tensors if (m := re.match(r"layers\.(\d+)\.", key))}),
            heads=tensors["layers.0.self_attn.q_proj.weight"].shape[0] // HEAD_DIM,
            kv_heads=tensors["layers.0.self_attn.k_proj.weight"].shape[0] // HEAD_DIM, vocab=vocab)
    except KeyError as e:
        raise ModelLoadError(f"{label} {path}: incomplete Mistral text model, no tensor for {e.args[0]}") from None
    model = adopt(label, path, lambda: MistralModel(config), tensors).eval()
    return model, find_processor(vocab, tokenizer_cache_dir, path, tiny_processor, tiny_vocab)


def language_model(full) -> torch.nn.Module:
    """The MistralModel inside a Mistral3ForConditionalGeneration (its text path), in eval mode."""
    return full.model.language_model.eval()


def find_processor(vocab_size: int, tokenizer_cache_dir: Optional[str], path: str,
                   tiny_processor: Callable[[], object], tiny_vocab: int):
    """The tiny processor for the tiny encoder, else Mistral-Small-3.1's (its chat template) from
    --tokenizer_cache_dir (folder `mistralai_Mistral-Small-3.1-24B-Instruct-2503`) or the local HF cache."""
    from transformers import AutoProcessor

    if vocab_size == tiny_vocab:
        return tiny_processor()
    sources = [os.path.join(tokenizer_cache_dir, TOKENIZER_REPO.replace("/", "_"))] if tokenizer_cache_dir else []
    folder = os.path.dirname(os.path.abspath(path))
    sources += [p for p in glob.glob(os.path.join(os.path.dirname(folder), "tokenizer")) if os.path.isdir(p)]
    for source in sources + [TOKENIZER_REPO]:
        try:
            return AutoProcessor.from_pretrained(source, local_files_only=True)
        except Exception:  # noqa: BLE001 - not cached / unreadable: try the next place
            continue
    raise ModelLoadError(f"--mistral3 {path}: the {TOKENIZER_REPO} processor is not cached locally; pass "
                         f"--tokenizer_cache_dir with a saved copy (folder {TOKENIZER_REPO.replace('/', '_')}), or "
                         f"give --mistral3 as a Mistral3 folder")
