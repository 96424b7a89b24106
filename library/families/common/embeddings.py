"""Textual-inversion embeddings for CLIP-style text encoders: new tokens in a tokenizer, their rows beside the
encoder's own token-embedding table, and the embedding files sd-scripts, A1111 / Forge, ComfyUI and diffusers use.

The new rows never enter the encoder's table: the table's embedding module looks up ids below the first new id in
its own weight (untouched, so every other row stays bitwise what it was) and the new ids in a separate tensor, which
training can make a parameter (library/train/adapters/textual_inversion.py). The encoder's state_dict keeps its keys.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from library.core.errors import ConfigError
from library.core.io_utils import atomic_path, save_safetensors_atomic


def token_strings(token_string: str, num_vectors: int) -> list[str]:
    """sd-scripts' names of the vectors of one token: "tok", "tok1", ..., "tok<N-1>"."""
    return [token_string] + [f"{token_string}{i + 1}" for i in range(num_vectors - 1)]


def add_tokens(tokenizer, strings: Sequence[str], flag: str = "--token_string") -> list[int]:
    """Add `strings` to `tokenizer`; their ids, consecutive from the tokenizer's old length. A string the tokenizer
    already holds as one entry (an added token, or a vocabulary entry as written) is refused by name, as sd-scripts."""
    vocab = tokenizer.get_vocab()
    for s in strings:
        if s in vocab:
            raise ConfigError(f"{flag} {s}: the tokenizer already has this token; use another string "
                              "(sd-scripts refuses it too)")
    first = len(tokenizer)
    added = tokenizer.add_tokens(list(strings))
    ids = tokenizer.convert_tokens_to_ids(list(strings))
    if added != len(strings) or ids != list(range(first, first + len(strings))):
        raise ConfigError(f"{flag} {strings[0]}: the tokenizer gave ids {ids}, expected {first}..{first + len(strings) - 1}")
    return ids


def init_word_ids(tokenizer, init_word: str, num_vectors: int) -> list[int]:
    """The token ids of --init_word, one per vector (fewer words are repeated, as sd-scripts). More tokens than
    vectors are refused (sd-scripts truncates them with a warning: docs/differences.md)."""
    ids = tokenizer.encode(init_word, add_special_tokens=False)
    if not ids:
        raise ConfigError(f"--init_word {init_word!r}: tokenizes to no token; give a word")
    if len(ids) > num_vectors:
        raise ConfigError(f"--init_word {init_word!r}: {len(ids)} tokens but --num_vectors_per_token is {num_vectors}; "
                          f"use --num_vectors_per_token {len(ids)} or fewer words")
    return [ids[i % len(ids)] for i in range(num_vectors)]


def input_embedding(text_encoder: nn.Module) -> nn.Embedding:
    """The token-embedding module of a transformers text encoder."""
    return text_encoder.get_input_embeddings()


def _lookup(embedding: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
    """The table's rows for its own ids; each installed block of rows for its ids."""
    extras = [(first, rows_of()) for first, rows_of in embedding.extra_rows]
    masks = [(input_ids >= first) & (input_ids < first + rows.shape[0]) for first, rows in extras]
    any_new = torch.zeros_like(input_ids, dtype=torch.bool)
    for m in masks:
        any_new |= m
    base_ids = torch.where(any_new, torch.zeros_like(input_ids), input_ids)
    out = F.embedding(base_ids, embedding.weight, embedding.padding_idx, embedding.max_norm, embedding.norm_type,
                      embedding.scale_grad_by_freq, embedding.sparse)
    for (first, rows), new in zip(extras, masks):
        extra = F.embedding((input_ids - first).clamp(0, rows.shape[0] - 1), rows.to(out.device)).to(out.dtype)
        out = torch.where(new.unsqueeze(-1), extra, out)
    return out


def install_rows(text_encoder: nn.Module, first_id: int, rows) -> None:
    """Make `text_encoder` look up ids first_id.. in `rows` (a tensor, or a callable giving one: a parameter that
    training replaces); its own table answers every other id. Installing again adds a block after the others."""
    embedding = input_embedding(text_encoder)
    table = embedding.weight.shape[0]
    if first_id < table:
        raise ConfigError(f"token id {first_id} is inside the encoder's table of {table} rows")
    rows_of = rows if callable(rows) else (lambda: rows)
    embedding.extra_rows = [*getattr(embedding, "extra_rows", []), (first_id, rows_of)]
    embedding.forward = lambda input_ids: _lookup(embedding, input_ids)


# --- files ------------------------------------------------------------------------------------------------------
def read_embedding_file(path: str) -> dict[str, torch.Tensor]:
    """The tensors of an embedding file: sd-scripts' / ComfyUI's safetensors ({"emb_params"} or {"clip_l",
    "clip_g"}), A1111's .pt ({"string_to_param": {"*": tensor}}) or a diffusers .bin ({token: tensor}); each one
    2-D (vectors, dim)."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such embedding file")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            data = load_file(path)
        else:
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a broken or foreign file: one line naming it
        raise ConfigError(f"{path}: not an embedding file ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
    if isinstance(data, dict) and "string_to_param" in data:
        data = data["string_to_param"]
        data = getattr(data, "_parameters", data)
    if not isinstance(data, dict) or not data or not all(torch.is_tensor(v) for v in data.values()):
        raise ConfigError(f"{path}: expected a dict of tensors (emb_params, clip_l / clip_g or string_to_param)")
    return {k: (v.unsqueeze(0) if v.dim() == 1 else v).detach().float() for k, v in data.items()}


def embeddings_for(data: dict[str, torch.Tensor], keys: Sequence[str], path: str) -> list[Optional[torch.Tensor]]:
    """One tensor per text encoder from a file's tensors: the family's keys (`keys`, one per encoder); a family
    with one encoder also takes a file with one tensor under another name (A1111's "*", diffusers' token)."""
    if len(keys) == 1 and keys[0] not in data and len(data) == 1:
        return [next(iter(data.values()))]
    found = [data.get(k) for k in keys]
    if all(v is None for v in found):
        raise ConfigError(f"{path}: has {', '.join(sorted(data))}, expected {' / '.join(keys)}")
    return found


def write_embedding_file(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """sd-scripts' embedding file, atomically: safetensors with metadata, or (.pt / .ckpt) torch.save of the dict."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    if path.endswith(".safetensors"):
        save_safetensors_atomic(tensors, path, metadata)
        return
    with atomic_path(path) as tmp:
        torch.save(tensors, tmp)


def recorded_token(path: str) -> Optional[str]:
    """The token a file written here records (ss_token_string), so that a step's file keeps the trained token."""
    if not path.endswith(".safetensors"):
        return None
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return (f.metadata() or {}).get("ss_token_string") or None


def load_embedding_into(tokenizers: list, text_encoders: list[nn.Module], keys: Sequence[str], path: str,
                        token: Optional[str] = None) -> tuple[str, list[str]]:
    """Add the embedding file at `path` to a loaded model under `token` (default: the token the file records, else
    its stem, as A1111):
    (token, its vector names). A prompt then writes the token; `expand_prompt` spells out its vectors."""
    token = token or recorded_token(path) or os.path.splitext(os.path.basename(path))[0]
    vectors = embeddings_for(read_embedding_file(path), keys, path)
    counts = {v.shape[0] for v in vectors if v is not None}
    if len(counts) != 1:
        raise ConfigError(f"{path}: the encoders' embeddings have different vector counts {sorted(counts)}")
    strings = token_strings(token, counts.pop())
    for tokenizer, encoder, rows in zip(tokenizers, text_encoders, vectors):
        ids = add_tokens(tokenizer, strings, flag=f"{path}: token")
        dim = input_embedding(encoder).weight.shape[1]
        if rows is None:  # SDXL file with one encoder's part only: the other keeps a zero vector
            rows = torch.zeros(len(strings), dim)
        if rows.shape[1] != dim:
            raise ConfigError(f"{path}: vectors of width {rows.shape[1]}, the text encoder's are {dim} wide")
        install_rows(encoder, ids[0], rows.to(input_embedding(encoder).weight.device))
    return token, strings


def expand_prompt(prompt: str, replacements: Sequence[tuple[str, str]]) -> str:
    """`prompt` with each multi-vector token written as all its vectors (sd-scripts' prompt replacement)."""
    for token, spelled in replacements:
        prompt = prompt.replace(token, spelled)
    return prompt
