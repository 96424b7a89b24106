"""The Qwen3 text encoder of Anima (Qwen3-0.6B), Z-Image and FLUX.2 [klein] (Qwen3-4B): its config at given sizes,
and loading it (`--qwen3`) from a transformers folder or one file (ComfyUI's `qwen_3_*.safetensors`: `model.*` keys,
or bare keys; lm_head ignored) with its tokenizer: the family's tiny one for the tiny encoder, else the real one
from --tokenizer_cache_dir or the local Hugging Face cache (never a download)."""

from __future__ import annotations

import os
import re
from typing import Callable, Optional

import torch

from library.families.base import ModelLoadError
from library.families.common.loading import adopt, cached_tokenizer, read_file

_QWEN3_MARKER = re.compile(r"(^|\.)layers\.0\.self_attn\.q_norm\.")


def qwen3_config(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int):
    """transformers.Qwen3Config of Qwen3's shape (its rope theta, eps, tied embeddings) at the given sizes."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim, hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6,
                       rope_theta=1000000.0, tie_word_embeddings=True, attention_bias=False, use_cache=False)


def preset_qwen3_config(preset, tokenizer):
    """qwen3_config of a preset's `qwen_hidden`, `qwen_intermediate`, `qwen_layers`, `qwen_heads`, `qwen_kv_heads`,
    `qwen_head_dim` and `qwen_vocab` (None: the vocabulary of `tokenizer`, the tiny one)."""
    p = preset
    return qwen3_config(hidden=p.qwen_hidden, intermediate=p.qwen_intermediate, layers=p.qwen_layers,
                        heads=p.qwen_heads, kv_heads=p.qwen_kv_heads, head_dim=p.qwen_head_dim,
                        vocab=p.qwen_vocab or len(tokenizer))


def _ready(tokenizer):
    """Right padding with <|endoftext|> (the EOS when the tokenizer names no pad token), as the pipelines and
    sd-scripts pad."""
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_qwen3(path: str, dtype: torch.dtype, tokenizer_cache_dir: Optional[str], *, tokenizer_repo: str,
               tiny_tokenizer: Callable[[], object]):
    """(Qwen3Model, tokenizer) from --qwen3 `path`; `tokenizer_repo` names the real tokenizer, `tiny_tokenizer`
    builds the family's tiny one (used when the file's vocabulary is the tiny one's)."""
    from transformers import AutoTokenizer, Qwen3Model

    label = "--qwen3"
    if os.path.isdir(path):
        try:
            model = Qwen3Model.from_pretrained(path, torch_dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{label} {path}: not a Qwen3 folder ({str(e).splitlines()[0][:200]})") from None
        return model.eval(), _ready(tokenizer)
    raw = read_file(label, path, "a Qwen3 text encoder (model.layers.*.self_attn.q_norm keys)",
                    lambda keys: any(_QWEN3_MARKER.search(k) for k in keys), dtype)
    tensors = {}
    for key, value in raw.items():
        key = key[len("model."):] if key.startswith("model.") else key
        if key.startswith(("embed_tokens.", "layers.", "norm.")):
            tensors[key] = value
    try:
        vocab, hidden = tensors["embed_tokens.weight"].shape
        head_dim = tensors["layers.0.self_attn.q_norm.weight"].shape[0]
        config = qwen3_config(hidden=hidden, intermediate=tensors["layers.0.mlp.gate_proj.weight"].shape[0],
                              layers=len({m[1] for key in tensors if (m := re.match(r"layers\.(\d+)\.", key))}),
                              heads=tensors["layers.0.self_attn.q_proj.weight"].shape[0] // head_dim,
                              kv_heads=tensors["layers.0.self_attn.k_proj.weight"].shape[0] // head_dim,
                              head_dim=head_dim, vocab=vocab)
    except KeyError as e:
        raise ModelLoadError(f"{label} {path}: incomplete Qwen3, no tensor for model.{e.args[0]}") from None
    model = adopt(label, path, lambda: Qwen3Model(config), tensors)
    return model, find_qwen3_tokenizer(vocab, tokenizer_cache_dir, path, tokenizer_repo, tiny_tokenizer)


def find_qwen3_tokenizer(vocab_size: int, tokenizer_cache_dir: Optional[str], path: str, tokenizer_repo: str,
                         tiny_tokenizer: Callable[[], object]):
    """The tiny tokenizer for the tiny encoder, else `tokenizer_repo`'s from --tokenizer_cache_dir or the local HF
    cache (Qwen3's embedding is padded past its vocabulary: a tokenizer no larger than it)."""
    tiny = tiny_tokenizer()
    if vocab_size == len(tiny):
        return tiny
    tokenizer = cached_tokenizer(tokenizer_repo, tokenizer_cache_dir, lambda t: 0 < len(t) <= vocab_size)
    if tokenizer is not None:
        return _ready(tokenizer)
    raise ModelLoadError(f"--qwen3 {path}: the {tokenizer_repo} tokenizer is not cached locally; pass "
                         f"--tokenizer_cache_dir with a saved copy (folder {tokenizer_repo.replace('/', '_')}), "
                         f"or give --qwen3 as a Qwen3 folder")
