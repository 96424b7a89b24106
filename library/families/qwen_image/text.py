"""Qwen-Image's text conditioning, as diffusers' QwenImagePipeline (and musubi-tuner) encode a prompt.

Each caption inside the chat template below (ending with the assistant turn's start), tokens right-padded, Qwen2.5-VL's
last hidden states (after its final norm), the template's first tokens dropped (34 with Qwen's tokenizer:
`prompt_template_encode_start_idx`), at most 1024 left. Outputs are padded to 1024 tokens so that cached captions
stack; the DiT call trims a batch back to its longest caption (padding is masked, so the image prediction is
unchanged).
"""

from __future__ import annotations

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
