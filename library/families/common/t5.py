"""The T5-XXL v1.1 text encoder several families share: its config, a small local tokenizer for tiny presets,
loading an encoder file (fp16 / fp8) and its tokenizer, and the single-file layout."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Mapping, Optional

import torch

from library.families.base import ModelLoadError
from library.families.common.loading import (
    adopt,
    read_file,
)

T5_MODEL_MAX_LENGTH = 512


@dataclasses.dataclass(frozen=True)
class T5Shape:
    """The widths `t5_config` reads (a family's preset has the same fields)."""

    t5_d_model: int
    t5_d_ff: int
    t5_heads: int
    t5_d_kv: int


T5_REAL_VOCAB_SIZE = 32128
# Words the tiny T5 tokenizer knows whole; anything else is spelled letter by letter.
_T5_WORDS = (
    "the a an of and in on with to at by for photo picture painting portrait landscape man woman girl boy "
    "person dog cat bird house tree flower sky water mountain city street red blue green yellow black white "
    "hair eyes face smiling standing sitting holding wearing dress shirt hat background detailed style"
).split()


T5_LAYERS = 24


def t5_config(p, vocab_size: int):
    """transformers.T5Config of the T5-XXL v1.1 encoder shape (gated GELU) at the widths of `p` (any preset with
    t5_d_model, t5_d_ff, t5_d_kv and t5_heads)."""
    from transformers import T5Config

    return T5Config(vocab_size=vocab_size, d_model=p.t5_d_model, d_ff=p.t5_d_ff, d_kv=p.t5_d_kv,
                    num_heads=p.t5_heads, num_layers=T5_LAYERS, feed_forward_proj="gated-gelu",
                    relative_attention_num_buckets=32, relative_attention_max_distance=128,
                    dense_act_fn="gelu_new", is_gated_act=True, tie_word_embeddings=False,
                    pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)


@functools.lru_cache(maxsize=1)
def _t5_vocab() -> tuple[tuple[str, float], ...]:
    letters = "abcdefghijklmnopqrstuvwxyz0123456789,.!?'-"
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    vocab += [("▁" + w, -1.0) for w in _T5_WORDS]
    vocab += [(c, -5.0) for c in letters] + [("▁" + c, -4.0) for c in letters]
    return tuple(vocab)


def build_t5_tokenizer():
    """A small local T5 tokenizer (SentencePiece-style Unigram, lower-cased; appends </s>)."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from transformers import T5TokenizerFast

    core = Tokenizer(models.Unigram(list(_t5_vocab()), unk_id=2, byte_fallback=False))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    core.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                        special_tokens=[("</s>", 1)])
    return T5TokenizerFast(tokenizer_object=core, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                           extra_ids=0, model_max_length=T5_MODEL_MAX_LENGTH)


def load_t5xxl_file(path: str, dtype: torch.dtype = torch.float32, tokenizer_cache_dir: Optional[str] = None):
    """(T5EncoderModel, tokenizer) from a T5-XXL encoder file (`shared.weight`, `encoder.block.N.*`; fp16/fp8 ok)."""
    label = "--t5xxl"
    tensors = read_file(label, path, T5XXL_FILE,
                         lambda keys: any(k.startswith("encoder.block.") for k in keys), dtype)
    return t5_from_tensors(label, path, tensors, tokenizer_cache_dir)


def t5_from_tensors(label: str, path: str, tensors: Mapping[str, torch.Tensor],
                    tokenizer_cache_dir: Optional[str] = None):
    """(T5EncoderModel, tokenizer) from T5 v1.1 encoder tensors (`shared.weight`, `encoder.block.N.*`), its shape
    read from them; `label` / `path` name the source in errors (FLUX.1's --t5xxl file, SD3's file or folder)."""
    import re

    from transformers import T5EncoderModel

    ckpt = t5_from_file(tensors)
    try:
        embedding = ckpt["shared.weight"]
        q = ckpt["encoder.block.0.layer.0.SelfAttention.q.weight"]
        bias = ckpt["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
        wi = ckpt["encoder.block.0.layer.1.DenseReluDense.wi_0.weight"]
    except KeyError as e:
        raise ModelLoadError(f"{label} {path}: expected a T5 v1.1 encoder (gated-GELU), no tensor for "
                             f"{e.args[0]}") from None
    heads = bias.shape[1]
    shape = T5Shape(t5_d_model=embedding.shape[1], t5_d_ff=wi.shape[0], t5_heads=heads, t5_d_kv=q.shape[0] // heads)
    config = t5_config(shape, embedding.shape[0])
    config.num_layers = len({m[1] for k in ckpt if (m := re.match(r"encoder\.block\.(\d+)\.", k))})
    config.relative_attention_num_buckets = bias.shape[0]
    tokenizer = find_t5_tokenizer(embedding.shape[0], tokenizer_cache_dir, path)
    model = adopt(label, path, lambda: T5EncoderModel(config), ckpt)
    model.tie_weights()  # adopting gave shared and embed_tokens separate Parameters over one tensor
    return model, tokenizer


def find_t5_tokenizer(vocab_size: int, tokenizer_cache_dir: Optional[str], path: str):
    """The local tiny T5 tokenizer for the tiny encoder, else T5-XXL's from --tokenizer_cache_dir or the HF cache."""
    from transformers import T5TokenizerFast


    tiny = build_t5_tokenizer()
    if vocab_size == len(tiny):
        return tiny
    sources = []
    if tokenizer_cache_dir:
        sources.append((os.path.join(tokenizer_cache_dir, T5_TOKENIZER_REPO.replace("/", "_")), {}))
    sources.append((T5_TOKENIZER_REPO, {"local_files_only": True}))
    for source, kwargs in sources:
        try:
            tokenizer = T5TokenizerFast.from_pretrained(source, **kwargs)
        except Exception:  # noqa: BLE001 - not cached / unreadable: try the next place
            continue
        if 0 < len(tokenizer) <= vocab_size:  # T5's embedding is padded past the vocabulary (32128 vs 32100)
            return tokenizer
    raise ModelLoadError(f"--t5xxl {path}: the {T5_TOKENIZER_REPO} tokenizer is not cached locally; pass "
                         f"--tokenizer_cache_dir with a saved copy (folder {T5_TOKENIZER_REPO.replace('/', '_')})")


T5_TIED = ("shared.weight", "encoder.embed_tokens.weight")  # one embedding stored under either name or both


def t5_to_file(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """T5EncoderModel tensors as a t5xxl.safetensors file holds them: the tied embedding once, as `shared.weight`."""
    return {k: v for k, v in state_dict.items() if k != T5_TIED[1]}


def t5_from_file(checkpoint: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A t5xxl.safetensors state dict as T5EncoderModel's: both names of the tied embedding, no decoder parts."""
    out = {k: v for k, v in checkpoint.items() if k.startswith("encoder.") or k == T5_TIED[0]}
    embedding = out.get(T5_TIED[0], out.get(T5_TIED[1]))
    if embedding is not None:
        out.update({name: embedding for name in T5_TIED})
    return out


# What a --t5xxl file should hold (for its error message).
T5XXL_FILE = "a T5-XXL text encoder (t5xxl_fp16.safetensors)"
T5_TOKENIZER_REPO = "google/t5-v1_1-xxl"  # the tokenizer sd-scripts pairs with t5xxl files
T5_TARGETS = ("T5Attention", "T5DenseGatedActDense")


