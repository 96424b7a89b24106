"""HunyuanImage 2.1's text conditioning, as sd-scripts' strategy_hunyuan_image / hunyuan_image_text_encoder do it.

- Qwen2.5-VL: each caption inside the chat template below (no assistant turn), tokens right-padded, the
  third-to-last hidden states, the template's first tokens dropped (34 with Qwen's tokenizer), at most 1024 left.
- byT5 (glyphs): the quoted parts of the caption ("...", ‘...’, “...”; not '...', as sd-scripts) written as
  `Text "x". ` each, 128 byte tokens; a caption without quotes gives zeros and an all-zero mask (ocr_mask False).

Outputs are padded to fixed lengths (1024 and 128) so that cached captions stack; the DiT call trims a batch back to
its longest caption (padding is masked, so the image prediction is unchanged), which is what sd-scripts' model does.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

QWEN_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
                 "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>")
QWEN_TEMPLATE_TOKENS = 34  # sd-scripts' PROMPT_TEMPLATE_ENCODE_START_IDX: the template prefix in Qwen's tokens
QWEN_MAX_TOKENS = 1024  # sd-scripts' TOKENIZER_MAX_LENGTH (after the prefix)
QWEN_HIDDEN_LAYER = -3  # the third-to-last hidden states
BYT5_MAX_TOKENS = 128
_QUOTES = (r"\"(.*?)\"", r"‘(.*?)’", r"“(.*?)”")  # sd-scripts leaves ASCII single quotes out
TEXT_KEYS = ("vlm_embed", "vlm_mask", "byt5_embed", "byt5_mask", "ocr_mask")  # also the keys of `_hi_te.npz`


def template_tokens(tokenizer) -> int:
    """How many leading tokens the template puts before a caption: 34 with Qwen2.5's tokenizer, counted for others."""
    if len(tokenizer) > 150000:
        return QWEN_TEMPLATE_TOKENS
    prefix = QWEN_TEMPLATE.split("{}")[0]
    return len(tokenizer(prefix, add_special_tokens=False).input_ids)


def glyph_text(caption: str) -> Optional[str]:
    """The byT5 input of a caption: `Text "a". Text "b". ` for its quoted parts, or None when it quotes nothing."""
    found = [text for pattern in _QUOTES for text in re.findall(pattern, caption)]
    return "".join(f'Text "{text}". ' for text in found) if found else None


def tokenize(qwen_tokenizer, byt5_tokenizer, captions: list[str]) -> list[torch.Tensor]:
    """[Qwen ids, Qwen mask] (B, prefix + 1024) and [byT5 ids, byT5 mask] (B, 128); zeros for a caption without
    quoted text."""
    drop = template_tokens(qwen_tokenizer)
    qwen = qwen_tokenizer([QWEN_TEMPLATE.format(c) for c in captions], padding="max_length",
                          max_length=QWEN_MAX_TOKENS + drop, truncation=True, return_tensors="pt")
    ids = torch.zeros(len(captions), BYT5_MAX_TOKENS, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, caption in enumerate(captions):
        glyphs = glyph_text(caption)
        if glyphs:
            out = byt5_tokenizer(glyphs, padding="max_length", max_length=BYT5_MAX_TOKENS, truncation=True,
                                 add_special_tokens=True, return_tensors="pt")
            ids[i], mask[i] = out.input_ids[0], out.attention_mask[0]
    return [qwen.input_ids, qwen.attention_mask.long(), ids, mask]


def encode(qwen, byt5, qwen_tokenizer, tokens: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The five conditioning tensors of tokenized captions (TEXT_KEYS)."""
    qwen_ids, qwen_mask, byt5_ids, byt5_mask = tokens
    drop = template_tokens(qwen_tokenizer)
    longest = max(int(qwen_mask.sum(1).max()), drop + 1)  # causal: the padding after it changes no valid token
    ids, mask = qwen_ids[:, :longest].to(qwen.device), qwen_mask[:, :longest].to(qwen.device)
    states = qwen(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[QWEN_HIDDEN_LAYER]
    states, mask = states[:, drop:], mask[:, drop:]
    pad = QWEN_MAX_TOKENS - states.shape[1]
    vlm_embed = torch.nn.functional.pad(states, (0, 0, 0, pad))
    vlm_mask = torch.nn.functional.pad(mask, (0, pad))
    ocr = byt5_mask.sum(1) > 0
    byt5_embed = torch.zeros(len(ocr), BYT5_MAX_TOKENS, byt5.config.d_model, dtype=byt5.dtype, device=byt5.device)
    if ocr.any():
        rows = ocr.nonzero().flatten()
        out = byt5(input_ids=byt5_ids[rows].to(byt5.device), attention_mask=byt5_mask[rows].float().to(byt5.device))
        byt5_embed[rows.to(byt5.device)] = out[0].to(byt5_embed.dtype)
    return {"vlm_embed": vlm_embed, "vlm_mask": vlm_mask, "byt5_embed": byt5_embed,
            "byt5_mask": byt5_mask.to(byt5.device), "ocr_mask": ocr.to(byt5.device)}


def trimmed(text: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Qwen states, mask, byT5 states, mask) cut to the batch's longest caption of each (at least one token)."""
    q = max(int(text["vlm_mask"].sum(1).max()), 1)
    b = max(int(text["byt5_mask"].sum(1).max()), 1)
    return text["vlm_embed"][:, :q], text["vlm_mask"][:, :q], text["byt5_embed"][:, :b], text["byt5_mask"][:, :b]
