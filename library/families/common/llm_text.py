"""Text from a decoder-only language model used as a text encoder (Gemma-2 for Lumina, Qwen3 for Z-Image)."""
from __future__ import annotations

import torch

from library.families.base import TextConditioning

# The conditioning's tensors, in the order second_to_last_states returns them.
TEXT_KEYS = ("hidden_state", "input_ids", "attention_mask")


def second_to_last_states(encoder: torch.nn.Module, tokens: list[torch.Tensor]) -> TextConditioning:
    """The encoder's second-to-last hidden states with the ids and mask they came from (`tokens`: ids, mask)."""
    ids, mask = (t.to(encoder.device) for t in tokens)
    states = encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2]
    return TextConditioning(dict(zip(TEXT_KEYS, (states, ids, mask))))
