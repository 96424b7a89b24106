"""Qwen2.5-VL-7B's language model as a text encoder (HunyuanImage 2.1 and Qwen-Image read it): its config, the tiny
local tokenizer in its shape, and loading it from one file (`model.*` keys, ComfyUI's qwen_2.5_vl_7b.safetensors;
`visual.*` and `lm_head` unused) or a transformers folder, the configuration read from tensor shapes."""

from __future__ import annotations

import os
import re
from typing import Optional

import torch

from library.families.base import ModelLoadError
from library.families.common.loading import adopt, cached_tokenizer, read_file
from library.families.common.tiny import tiny_vocab_and_merges

QWEN_TOKENIZER_REPO = "Qwen/Qwen2.5-VL-7B-Instruct"  # the tokenizer sd-scripts' strategy uses
QWEN_REAL_VOCAB_SIZE = 152064
QWEN_PAD, QWEN_IM_START, QWEN_IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"


def qwen_config(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
                mrope_section: tuple[int, int, int]):
    """transformers' Qwen2.5-VL text config (the language model sd-scripts and the Qwen-Image pipeline read) at the
    given sizes."""
    from transformers import Qwen2_5_VLTextConfig

    return Qwen2_5_VLTextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                hidden_act="silu", max_position_embeddings=128000, rms_norm_eps=1e-6,
                                rope_scaling={"type": "default", "mrope_section": list(mrope_section)},
                                rope_theta=1000000.0, use_cache=False, bos_token_id=None, eos_token_id=None,
                                pad_token_id=None)


def build_qwen_tokenizer():
    """A small local tokenizer in Qwen2.5's shape: byte-level BPE, no BOS, <|endoftext|> pads, the chat markers
    <|im_start|> / <|im_end|> as single tokens, right padding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab, merges = tiny_vocab_and_merges()
    tokens = {t: i for i, t in enumerate(t for t in vocab if not t.endswith("</w>") and not t.startswith("<|"))}
    ordered = [(a, b) for a, b in merges if not b.endswith("</w>") and a + b in tokens]
    core = Tokenizer(models.BPE(vocab=tokens, merges=ordered))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=QWEN_IM_END, pad_token=QWEN_PAD,
                                        additional_special_tokens=[QWEN_IM_START], model_max_length=131072)
    tokenizer.padding_side = "right"
    return tokenizer


def load_qwen_vl(path: str, dtype: torch.dtype, tokenizer_cache_dir: Optional[str] = None):
    """(Qwen2_5_VLTextModel, tokenizer) from --text_encoder: one file (`model.*` keys) or a transformers folder."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLTextModel

    label = "--text_encoder"
    if os.path.isdir(path):
        try:
            whole = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, torch_dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{label} {path}: not a Qwen2.5-VL folder ({str(e).splitlines()[0][:200]})") from None
        tokenizer.padding_side = "right"
        return whole.model.language_model.eval(), tokenizer
    raw = read_file(label, path, "a Qwen2.5-VL text encoder (model.layers.* keys)",
                    lambda keys: "model.layers.0.self_attn.q_proj.bias" in keys, dtype)
    tensors = {k[len("model."):]: v for k, v in raw.items() if k.startswith("model.")}
    try:
        vocab, hidden = tensors["embed_tokens.weight"].shape
        q, k = tensors["layers.0.self_attn.q_proj.weight"].shape[0], tensors["layers.0.self_attn.k_proj.weight"].shape[0]
        # Qwen2.5-VL-7B: 28 heads of 128; the tiny preset: 2 heads of 16 (read as q width / 128, or 16 when small)
        head_dim = 128 if q % 128 == 0 and k % 128 == 0 else 16
        # multimodal RoPE sections (16, 24, 24 of 64 for the 7B); text-only input gives all three the same positions
        half = head_dim // 2
        mrope = (half // 4, 3 * half // 8, half - half // 4 - 3 * half // 8)
        config = qwen_config(hidden, tensors["layers.0.mlp.gate_proj.weight"].shape[0],
                             len({m[1] for key in tensors if (m := re.match(r"layers\.(\d+)\.", key))}),
                             q // head_dim, k // head_dim, vocab, mrope)
    except KeyError as e:
        raise ModelLoadError(f"{label} {path}: incomplete Qwen2.5-VL, no tensor for model.{e.args[0]}") from None
    model = adopt(label, path, lambda: Qwen2_5_VLTextModel(config), tensors)
    return model, find_qwen_tokenizer(vocab, tokenizer_cache_dir, path)


def find_qwen_tokenizer(vocab_size: int, tokenizer_cache_dir: Optional[str], path: str):
    """The tiny tokenizer for the tiny encoder, else Qwen2.5-VL's from --tokenizer_cache_dir or the local HF cache."""
    tiny = build_qwen_tokenizer()
    if vocab_size == len(tiny):
        return tiny
    tokenizer = cached_tokenizer(QWEN_TOKENIZER_REPO, tokenizer_cache_dir)
    if tokenizer is not None:
        tokenizer.padding_side = "right"
        return tokenizer
    raise ModelLoadError(f"--text_encoder {path}: the {QWEN_TOKENIZER_REPO} tokenizer is not cached locally; pass "
                         f"--tokenizer_cache_dir with a saved copy (folder {QWEN_TOKENIZER_REPO.replace('/', '_')})")
