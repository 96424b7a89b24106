"""Built-in SD models (tiny test models and full-size random ones) and the local CLIP tokenizer.

Everything here is built from config with a fixed seed: no file or network is
needed, and the same preset gives bitwise the same weights every time.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Sequence

import torch
from torch import nn



BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
# SD2's tokenizer (stabilityai/stable-diffusion-2) pads with "!", id 0; SD1's pads with EOS.
SD2_PAD_TOKEN = "!"
MODEL_MAX_LENGTH = 77
PRESET_SEED = 20240601

# Common words of image captions; their letter-by-letter merges make the toy
# tokenizer split real captions into word-sized tokens, like the real one.
_WORDS = (
    "the a an of and in on with to at by for from is are his her their its this that "
    "photo picture painting drawing illustration portrait landscape close up full body "
    "man woman girl boy person people child dog cat bird horse car house tree trees "
    "flower flowers sky cloud clouds sun moon water river lake sea ocean beach mountain "
    "city street road forest field grass snow rain night day light dark red blue green "
    "yellow black white brown pink purple orange gray gold silver hair eyes face hand "
    "hands smile smiling standing sitting walking running holding wearing looking "
    "dress shirt hat glasses jacket background simple detailed high quality best masterpiece "
    "art style anime realistic digital oil watercolor sketch 1girl 1boy solo outdoors indoors "
    "long short blonde table chair window room wall floor door book cup food"
).split()


def bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: each of the 256 bytes mapped to a printable character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    shift = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + shift)
            shift += 1
    return dict(zip(printable, (chr(c) for c in codes)))


@functools.lru_cache(maxsize=1)
def tiny_vocab_and_merges() -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    """Vocabulary (tokens -> ids) and ranked merges of the local CLIP tokenizer.

    Layout as in CLIP's: the 256 byte characters, then their `</w>` forms, then
    one token per merge, then `<|startoftext|>` and `<|endoftext|>` last.
    """
    alphabet = list(bytes_to_unicode().values())
    tokens = alphabet + [c + "</w>" for c in alphabet]
    known = set(tokens)
    merges: list[tuple[str, str]] = []
    for word in _WORDS:
        # Build the word left to right: ((w o) r) d</w>; the ranks follow creation order.
        symbols = list(word[:-1]) + [word[-1] + "</w>"]
        current = symbols[0]
        for nxt in symbols[1:]:
            merged = current + nxt
            if merged not in known:
                merges.append((current, nxt))
                tokens.append(merged)
                known.add(merged)
            current = merged
    tokens += [BOS_TOKEN, EOS_TOKEN]
    return {t: i for i, t in enumerate(tokens)}, tuple(merges)


def build_tokenizer(v2: bool):
    """The local CLIP tokenizer (no download); pads with EOS for SD1 and with "!" for SD2."""
    from transformers import CLIPTokenizer

    vocab, merges = tiny_vocab_and_merges()
    return CLIPTokenizer(vocab=dict(vocab), merges=list(merges), bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                         unk_token=EOS_TOKEN, pad_token=SD2_PAD_TOKEN if v2 else EOS_TOKEN,
                         model_max_length=MODEL_MAX_LENGTH)


def tiny_byte_level_bpe(before: Sequence[str] = (), after: Sequence[str] = ()):
    """A `tokenizers.Tokenizer` of byte-level BPE over the tiny vocabulary's words and merges (without the CLIP
    tokenizer's `</w>` forms and `<|...|>` tokens), the LLM tokenizers' tiny core; `before` take the first ids,
    `after` the ids after the words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = tiny_vocab_and_merges()
    words = [t for t in vocab if not t.endswith("</w>") and not t.startswith("<|")]
    tokens = {t: i for i, t in enumerate([*before, *words, *after])}
    ordered = [(a, b) for a, b in merges if not b.endswith("</w>") and a + b in tokens]
    core = Tokenizer(models.BPE(vocab=tokens, merges=ordered))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return core


def tiny_vocab_size() -> int:
    """Vocabulary size of the local tokenizer (and of the tiny text encoders)."""
    return len(tiny_vocab_and_merges()[0])


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch's CPU RNG for the block and restore the caller's RNG state afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def draw_zero_parameters(module: nn.Module, std: float = 0.02) -> None:
    """Every all-zero parameter of `module` drawn from N(0, std²) in place, from the caller's RNG: the zero-initialised
    parts of a DiT (AdaLN, final layer, pad tokens) would make a tiny preset predict 0 and train nothing visible."""
    with torch.no_grad():
        for tensor in module.parameters():
            if not tensor.abs().any():
                tensor.normal_(0.0, std)


def build_seeded(factory, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """`factory()` with weights drawn from `seed` (caller's RNG untouched); on "meta", no memory and no seed."""
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            return factory()
    with seeded(seed):
        return factory().to(device)


