"""Qwen2.5-VL-7B as a text encoder (HunyuanImage 2.1 and Qwen-Image read its language model; Qwen-Image-Edit its
vision tower too): its configs, the tiny local tokenizer in its shape (with the vision markers for the edit preset),
the image processor, and loading it from one file (`model.*` keys, ComfyUI's qwen_2.5_vl_7b.safetensors; `visual.*`
read only with the vision tower, `lm_head` unused) or a transformers folder, the configuration read from tensor
shapes."""

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
# Qwen2.5's vision markers (ids 151652..151656 in the real vocabulary), in its order
QWEN_VL_MIN_PIXELS, QWEN_VL_MAX_PIXELS = 3136, 12845056  # Qwen2.5-VL-7B-Instruct preprocessor_config.json
QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


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


def build_qwen_tokenizer(vision: bool = False):
    """A small local tokenizer in Qwen2.5's shape: byte-level BPE, no BOS, <|endoftext|> pads, the chat markers
    <|im_start|> / <|im_end|> as single tokens (`vision`: Qwen2.5's vision markers too, after them), right padding."""
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
    if vision:
        tokenizer.add_special_tokens({"additional_special_tokens": [QWEN_IM_START, *QWEN_VISION_TOKENS]})
    tokenizer.padding_side = "right"
    return tokenizer


def tiny_vision_config(out_hidden: int) -> dict:
    """The tiny presets' Qwen2.5-VL vision tower: one block 16 wide (2 heads), Qwen's 14-pixel patches merged 2x2,
    2 frames a patch, its window size."""
    return dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=out_hidden,
                patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                fullatt_block_indexes=[0])


def vl_config(text_config, vision: dict, tokenizer):
    """transformers' Qwen2_5_VLConfig of a text config and a vision tower, with the tokenizer's vision-marker ids."""
    from transformers import Qwen2_5_VLConfig

    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in (
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
        ("vision_token_id", "<|vision_pad|>"), ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"))}
    text = text_config.to_dict() if hasattr(text_config, "to_dict") else dict(text_config)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)


def vl_image_processor():
    """Qwen2.5-VL's image processor as Qwen2.5-VL-7B-Instruct's preprocessor_config.json sets it: 14-pixel patches
    merged 2x2, 3136..12845056 pixels (transformers' own default stops at 1003520, which would shrink the original
    Edit's ~1024² images), CLIP's mean / std."""
    import warnings

    from transformers import Qwen2VLImageProcessor

    with warnings.catch_warnings():  # without torchvision transformers says it uses the PIL one (the same steps)
        warnings.simplefilter("ignore")
        return Qwen2VLImageProcessor(min_pixels=QWEN_VL_MIN_PIXELS, max_pixels=QWEN_VL_MAX_PIXELS)


def vl_processor(tokenizer, image_processor=None):
    """transformers' Qwen2VLProcessor of a tokenizer and an image processor (what QwenImageEditPlusPipeline calls).
    Its constructor also wants a video processor, which needs torchvision; without it the processor is assembled
    with no video processor (images only, the same code path)."""
    from transformers import Qwen2VLProcessor

    image_processor = image_processor or vl_image_processor()
    try:
        return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer)
    except (AttributeError, TypeError, ValueError, ImportError):
        processor = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
        fields = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",  # what its __init__ sets
                  "image_token_id": tokenizer.convert_tokens_to_ids("<|image_pad|>"),
                  "video_token_id": tokenizer.convert_tokens_to_ids("<|video_pad|>"),
                  "image_processor": image_processor, "tokenizer": tokenizer, "video_processor": None,
                  "chat_template": None}
        for name, value in fields.items():
            setattr(processor, name, value)
        return processor


def load_qwen_vl(path: str, dtype: torch.dtype, tokenizer_cache_dir: Optional[str] = None, vision: bool = False):
    """(Qwen2_5_VLTextModel, tokenizer) from --text_encoder: one file (`model.*` keys) or a transformers folder.
    `vision`: (Qwen2_5_VLModel, tokenizer), the vision tower too (the file's `visual.*` keys)."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLModel, Qwen2_5_VLTextModel

    label = "--text_encoder"
    if os.path.isdir(path):
        try:
            whole = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, torch_dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{label} {path}: not a Qwen2.5-VL folder ({str(e).splitlines()[0][:200]})") from None
        tokenizer.padding_side = "right"
        return (whole.model if vision else whole.model.language_model).eval(), tokenizer
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
    if not vision:
        model = adopt(label, path, lambda: Qwen2_5_VLTextModel(config), tensors)
        return model, find_qwen_tokenizer(vocab, tokenizer_cache_dir, path)
    tokenizer = find_qwen_tokenizer(vocab, tokenizer_cache_dir, path, vision=True)
    visual = {k[len("visual."):]: v for k, v in raw.items() if k.startswith("visual.")}
    if not visual:
        raise ModelLoadError(f"{label} {path}: no vision tower (visual.* keys); Qwen-Image-Edit reads the control "
                             f"images with it (ComfyUI's qwen_2.5_vl_7b.safetensors has it)")
    try:
        vision_cfg = vision_config_from(visual)
    except KeyError as e:
        raise ModelLoadError(f"{label} {path}: incomplete Qwen2.5-VL vision tower, no tensor for visual.{e.args[0]}") \
            from None
    whole = {**{"language_model." + k: v for k, v in tensors.items()}, **{"visual." + k: v for k, v in visual.items()}}
    model = adopt(label, path, lambda: Qwen2_5_VLModel(vl_config(config, vision_cfg, tokenizer)), whole)
    return model.eval(), tokenizer


def vision_config_from(visual: dict) -> dict:
    """Qwen2.5-VL's vision config read from its tensors (`visual.` stripped): the 7B's 32 blocks of 1280 (16 heads of
    80, full attention every 8th block) or the tiny tower (heads of 8)."""
    hidden, _, temporal, patch, _ = visual["patch_embed.proj.weight"].shape
    depth = len({m[1] for key in visual if (m := re.match(r"blocks\.(\d+)\.", key))})
    head_dim = 80 if hidden % 80 == 0 else 8
    return dict(depth=depth, hidden_size=hidden, intermediate_size=visual["blocks.0.mlp.gate_proj.weight"].shape[0],
                num_heads=hidden // head_dim, out_hidden_size=visual["merger.mlp.2.weight"].shape[0], patch_size=patch,
                spatial_merge_size=2, temporal_patch_size=temporal, window_size=112,
                fullatt_block_indexes=[i for i in range(depth) if (i + 1) % 8 == 0] or [depth - 1])


def find_qwen_tokenizer(vocab_size: int, tokenizer_cache_dir: Optional[str], path: str, vision: bool = False):
    """The tiny tokenizer for the tiny encoder, else Qwen2.5-VL's from --tokenizer_cache_dir or the local HF cache."""
    for tiny in (build_qwen_tokenizer(vision), build_qwen_tokenizer(not vision)):  # the tiny presets' two
        if vocab_size == len(tiny):
            return tiny
    tokenizer = cached_tokenizer(QWEN_TOKENIZER_REPO, tokenizer_cache_dir)
    if tokenizer is not None:
        tokenizer.padding_side = "right"
        return tokenizer
    raise ModelLoadError(f"--text_encoder {path}: the {QWEN_TOKENIZER_REPO} tokenizer is not cached locally; pass "
                         f"--tokenizer_cache_dir with a saved copy (folder {QWEN_TOKENIZER_REPO.replace('/', '_')})")
