"""Qwen-Image's text conditioning, as diffusers' QwenImagePipeline (and musubi-tuner) encode a prompt.

Each caption inside the chat template below (ending with the assistant turn's start), tokens right-padded, Qwen2.5-VL's
last hidden states (after its final norm), the template's first tokens dropped (34 with Qwen's tokenizer:
`prompt_template_encode_start_idx`), at most 1024 left. Outputs are padded to 1024 tokens so that cached captions
stack; the DiT call trims a batch back to its longest caption (padding is masked, so the image prediction is
unchanged).
"""

from __future__ import annotations

import math
import os

import torch

QWEN_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
                 "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
                 "<|im_start|>assistant\n")
QWEN_TEMPLATE_TOKENS = 34  # diffusers' prompt_template_encode_start_idx: the template prefix in Qwen's tokens
QWEN_MAX_TOKENS = 1024  # diffusers' tokenizer_max_length (after the prefix)
QWEN_HIDDEN_LAYER = -1  # the last hidden states
TEXT_KEYS = ("prompt_embeds", "prompt_mask")


def template_tokens(tokenizer) -> int:
    """How many leading tokens the template puts before a caption: 34 with Qwen2.5's tokenizer, counted for others."""
    if len(tokenizer) > 150000:
        return QWEN_TEMPLATE_TOKENS
    prefix = QWEN_TEMPLATE.split("{}")[0]
    return len(tokenizer(prefix, add_special_tokens=False).input_ids)


def tokenize(tokenizer, captions: list[str]) -> list[torch.Tensor]:
    """[ids, mask] (B, prefix + 1024)."""
    drop = template_tokens(tokenizer)
    out = tokenizer([QWEN_TEMPLATE.format(c) for c in captions], padding="max_length",
                    max_length=QWEN_MAX_TOKENS + drop, truncation=True, return_tensors="pt")
    return [out.input_ids, out.attention_mask.long()]


def encode(qwen, tokenizer, tokens: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """prompt_embeds (B, 1024, hidden) and prompt_mask (B, 1024) of tokenized captions."""
    ids, mask = tokens
    drop = template_tokens(tokenizer)
    longest = max(int(mask.sum(1).max()), drop + 1)  # causal: the padding after it changes no valid token
    ids, mask = ids[:, :longest].to(qwen.device), mask[:, :longest].to(qwen.device)
    states = qwen(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[QWEN_HIDDEN_LAYER]
    states, mask = states[:, drop:], mask[:, drop:]
    states = states * mask[..., None].to(states.dtype)  # zeros at padding, as the pipeline's stacking
    pad = QWEN_MAX_TOKENS - states.shape[1]
    return {"prompt_embeds": torch.nn.functional.pad(states, (0, 0, 0, pad)),
            "prompt_mask": torch.nn.functional.pad(mask, (0, pad))}


def trimmed(text: dict[str, torch.Tensor], multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(states, mask) cut to the batch's longest caption (at least one token), rounded up to a multiple of
    `multiple` with masked padding (context parallelism splits the text tokens over that many processes)."""
    n = -(-max(int(text["prompt_mask"].sum(1).max()), 1) // multiple) * multiple
    states, mask = text["prompt_embeds"][:, :n], text["prompt_mask"][:, :n]
    pad = n - states.shape[1]
    return torch.nn.functional.pad(states, (0, 0, 0, pad)), torch.nn.functional.pad(mask, (0, pad))


# --- Qwen-Image-Edit: the caption with its control images, as QwenImageEditPipeline / QwenImageEditPlusPipeline ----
# (diffusers 0.42.1 pipeline_qwenimage_edit.py / pipeline_qwenimage_edit_plus.py): Qwen2.5-VL reads the images through
# its vision tower; the template's first 64 tokens (the system turn) are dropped.
_EDIT_SYSTEM = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                "objects, background), then explain how the user's text instruction should alter or modify the image. "
                "Generate a new image that meets the user's requirements while maintaining consistency with the "
                "original input where appropriate.<|im_end|>\n<|im_start|>user\n")
EDIT_TEMPLATE = _EDIT_SYSTEM + "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"
EDIT_PLUS_TEMPLATE = _EDIT_SYSTEM + "{}<|im_end|>\n<|im_start|>assistant\n"
EDIT_PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"  # 2509 / 2511: before the caption, per image
EDIT_TEMPLATE_TOKENS = 64  # the pipelines' prompt_template_encode_start_idx with Qwen's tokenizer
CONDITION_AREA = 384 * 384  # 2509 / 2511: each control image as Qwen2.5-VL sees it (CONDITION_IMAGE_SIZE)
VAE_AREA = 1024 * 1024  # each control image as the VAE encodes it at generation (VAE_IMAGE_SIZE); Edit: VL too
# Outputs are padded to this many tokens so that cached entries stack (caption <= 1024 tokens + the images' tokens:
# ~196 per 384² image, ~1369 per 1024² image)
EDIT_MAX_TOKENS = {"edit": 2560, "edit-2509": 2048, "edit-2511": 2048}
_KEY_SEP, _STAMP_SEP = "\x00", "\x01"


def calculate_dimensions(target_area: int, ratio: float) -> tuple[int, int]:
    """(width, height) of about `target_area` pixels at aspect `ratio`, multiples of 32 (the pipelines' rule)."""
    width = math.sqrt(target_area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


def edit_key(caption: str, control_paths) -> str:
    """The text key of a caption with control images: the caption, then each image's path with its size and mtime
    (the encoding depends on the images: a changed image is another key, so a cached entry of it is rebuilt)."""
    parts = [caption]
    for path in control_paths:
        try:
            st = os.stat(path)
            stamp = f"{st.st_size}:{st.st_mtime_ns}"
        except OSError:
            stamp = "missing"
        parts.append(f"{path}{_STAMP_SEP}{stamp}")
    return _KEY_SEP.join(parts)


def split_edit_key(key: str) -> tuple[str, list[str]]:
    """(caption, control image paths) of an edit_key (a plain caption has none)."""
    caption, *rest = key.split(_KEY_SEP)
    return caption, [part.split(_STAMP_SEP)[0] for part in rest]


def read_control(path: str):
    """A control image file as an RGB PIL image (a one-line ConfigError naming it when it cannot be read)."""
    from PIL import Image

    from library.core.errors import ConfigError

    try:
        with Image.open(path) as f:
            return f.convert("RGB")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: control image cannot be read ({e})") from None


def vl_image(path_or_image, version: str):
    """A control image as Qwen2.5-VL gets it: RGB, resized (Lanczos, as VaeImageProcessor.resize) to about 384²
    pixels (2509 / 2511) or 1024² (Edit) at its own aspect ratio, sides multiples of 32."""
    from PIL import Image

    image = read_control(path_or_image) if isinstance(path_or_image, str) else path_or_image
    w, h = image.size
    width, height = calculate_dimensions(VAE_AREA if version == "edit" else CONDITION_AREA, w / h)
    return image.resize((width, height), resample=Image.Resampling.LANCZOS)


def edit_prompt_texts(captions: list[str], image_counts: list[int], version: str) -> list[str]:
    """The templated prompts of the pipeline: Edit's template holds one image; 2509 / 2511 put "Picture N: ..."
    before the caption for each image. (Edit without an image: the template without its image markers.)"""
    if version == "edit":
        plain = EDIT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "")
        return [(EDIT_TEMPLATE if n else plain).format(c) for c, n in zip(captions, image_counts)]
    return [EDIT_PLUS_TEMPLATE.format("".join(EDIT_PICTURE.format(i + 1) for i in range(n)) + c)
            for c, n in zip(captions, image_counts)]


def edit_template_tokens(tokenizer) -> int:
    """The system turn's tokens: 64 with Qwen2.5's tokenizer, counted for others."""
    if len(tokenizer) > 150000:
        return EDIT_TEMPLATE_TOKENS
    return len(tokenizer(_EDIT_SYSTEM, add_special_tokens=False).input_ids)


def tokenize_edit(processor, keys: list[str], version: str) -> list[torch.Tensor]:
    """[ids, mask] or [ids, mask, pixel_values, image_grid_thw] of text keys (edit_key), through Qwen2VLProcessor as
    the pipeline calls it (padding to the longest)."""
    captions, images, counts = [], [], []
    for key in keys:
        caption, paths = split_edit_key(key)
        captions.append(caption)
        counts.append(len(paths))
        images += [vl_image(p, version) for p in paths]
    out = processor(text=edit_prompt_texts(captions, counts, version), images=images or None, padding=True,
                    return_tensors="pt")
    tokens = [out["input_ids"], out["attention_mask"].long()]
    return tokens + [out["pixel_values"], out["image_grid_thw"]] if images else tokens


def encode_edit(vl, tokenizer, tokens: list[torch.Tensor], version: str) -> dict[str, torch.Tensor]:
    """prompt_embeds (B, EDIT_MAX_TOKENS[version], hidden) and prompt_mask of tokenize_edit's output: Qwen2.5-VL's last
    hidden states (Qwen2_5_VLModel, as the pipeline's Qwen2_5_VLForConditionalGeneration computes them), the system
    turn dropped, zeros after each prompt."""
    from library.core.errors import ConfigError

    ids, mask = tokens[0].to(vl.device), tokens[1].to(vl.device)
    images = {}
    if len(tokens) > 2:
        images = {"pixel_values": tokens[2].to(vl.device), "image_grid_thw": tokens[3].to(vl.device)}
    states = vl(input_ids=ids, attention_mask=mask, output_hidden_states=True, **images).hidden_states[-1]
    drop = edit_template_tokens(tokenizer)
    states, mask = states[:, drop:], mask[:, drop:]
    states = states * mask[..., None].to(states.dtype)
    limit = EDIT_MAX_TOKENS[version]
    if states.shape[1] > limit:
        raise ConfigError(f"a caption with its control images takes {states.shape[1]} tokens; Qwen-Image-Edit "
                          f"({version}) is kept to {limit}: shorten the caption")
    pad = limit - states.shape[1]
    return {"prompt_embeds": torch.nn.functional.pad(states, (0, 0, 0, pad)),
            "prompt_mask": torch.nn.functional.pad(mask, (0, pad))}
