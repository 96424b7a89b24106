"""Textual inversion: what trains is the embedding of a new token, one vector per --num_vectors_per_token, in each
text encoder (train_textual_inversion.py, sdxl_train_textual_inversion.py; docs/textual_inversion.md).

The new vectors are a parameter of their own beside each encoder's token table (library/families/common/
embeddings.py), so the table itself, the rest of the text encoder and the UNet stay frozen and bitwise unchanged.
The file written is sd-scripts': {"emb_params": (N, dim)} for SD 1.x / 2.x, {"clip_l", "clip_g"} for SDXL (the
family's `textual_inversion_keys`).
"""

from __future__ import annotations

import copy
import logging
from typing import Optional

import torch
from torch import nn

from library.core.errors import ConfigError
from library.families.base import Components, ModelFamily
from library.families.common.embeddings import (
    add_tokens,
    embeddings_for,
    init_word_ids,
    input_embedding,
    install_rows,
    load_embedding_into,
    read_embedding_file,
    token_strings,
    write_embedding_file,
)
from library.train import checkpoints as ckpt
from library.train.adapters.network_setup import SAVE_DTYPES
from library.train.adapters.trainables import Trainable
from library.train.settings import TextualInversionOptions

logger = logging.getLogger(__name__)

# sd-scripts' templates (from textual inversion's imagenet templates): --use_object_template / --use_style_template
# train on one of these, drawn per sample, instead of the captions; {} is the token (all its vectors).
OBJECT_TEMPLATES = (
    "a photo of a {}", "a rendering of a {}", "a cropped photo of the {}", "the photo of a {}",
    "a photo of a clean {}", "a photo of a dirty {}", "a dark photo of the {}", "a photo of my {}",
    "a photo of the cool {}", "a close-up photo of a {}", "a bright photo of the {}", "a cropped photo of a {}",
    "a photo of the {}", "a good photo of the {}", "a photo of one {}", "a close-up photo of the {}",
    "a rendition of the {}", "a photo of the clean {}", "a rendition of a {}", "a photo of a nice {}",
    "a good photo of a {}", "a photo of the nice {}", "a photo of the small {}", "a photo of the weird {}",
    "a photo of the large {}", "a photo of a cool {}", "a photo of a small {}",
)
STYLE_TEMPLATES = (
    "a painting in the style of {}", "a rendering in the style of {}", "a cropped painting in the style of {}",
    "the painting in the style of {}", "a clean painting in the style of {}", "a dirty painting in the style of {}",
    "a dark painting in the style of {}", "a picture in the style of {}", "a cool painting in the style of {}",
    "a close-up painting in the style of {}", "a bright painting in the style of {}",
    "a cropped painting in the style of {}", "a good painting in the style of {}",
    "a close-up painting in the style of {}", "a rendition in the style of {}", "a nice painting in the style of {}",
    "a small painting in the style of {}", "a weird painting in the style of {}",
    "a large painting in the style of {}",
)


def caption_rules(opts: TextualInversionOptions) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """(replacements, templates) for the captions, as sd-scripts: with a template flag every caption is one of the
    templates (drawn per sample) with the token's vectors spelled out; otherwise a multi-vector token written in a
    caption becomes all its vectors ("tok" -> "tok tok1 tok2")."""
    spelled = " ".join(token_strings(opts.token_string, opts.num_vectors_per_token))
    if opts.use_object_template or opts.use_style_template:
        templates = OBJECT_TEMPLATES if opts.use_object_template else STYLE_TEMPLATES
        return (), tuple(t.format(spelled) for t in templates)
    if opts.num_vectors_per_token > 1:
        return ((opts.token_string, spelled),), ()
    return (), ()


class TextualInversionTrainable(Trainable):
    """The new token's vectors in each text encoder, one parameter per encoder (named by the file key)."""

    is_adapter = False
    saves_whole_model = False

    def __init__(self, family: ModelFamily, components: Components, opts: TextualInversionOptions,
                 save_model_as: str, save_precision: Optional[str], *, device: torch.device,
                 full_dtype: torch.dtype):
        keys = family.textual_inversion_keys
        if not keys:
            raise ConfigError(f"textual inversion: not available for {family.name} (sd-scripts has it for SD 1.x/2.x "
                              "and SDXL)")
        self.opts, self.keys = opts, keys
        self.save_model_as, self.save_precision = save_model_as, save_precision
        self.strings = token_strings(opts.token_string, opts.num_vectors_per_token)
        n = len(self.strings)
        start = None
        if opts.weights:
            start = embeddings_for(read_embedding_file(opts.weights), keys, opts.weights)
            for key, rows in zip(keys, start):
                if rows is not None and rows.shape[0] != n:
                    raise ConfigError(f"--weights {opts.weights}: {key} has {rows.shape[0]} vector(s) but "
                                      f"--num_vectors_per_token is {n}")
        params = {}
        self.token_ids: list[list[int]] = []
        for i, key in enumerate(keys):
            # a copy: the loaded tokenizer may be shared (a cached model); this run's gains the new tokens
            tokenizer = copy.deepcopy(components.tokenizers[i])
            components.tokenizers[i] = tokenizer
            init_ids = init_word_ids(tokenizer, opts.init_word, n) if opts.init_word else None
            ids = add_tokens(tokenizer, self.strings)
            table = input_embedding(components.text_encoders[i]).weight.detach()
            if start is not None and start[i] is not None:
                rows = start[i]
                if rows.shape[1] != table.shape[1]:
                    raise ConfigError(f"--weights {opts.weights}: {key} vectors are {rows.shape[1]} wide, the text "
                                      f"encoder's {table.shape[1]}")
            elif init_ids is not None:
                rows = table[init_ids]
            else:  # no --init_word: every vector starts at the table's mean row (docs/differences.md)
                rows = table.float().mean(dim=0, keepdim=True).expand(n, -1)
            params[key] = nn.Parameter(rows.detach().to(device, full_dtype).clone())
            self.token_ids.append(ids)
            logger.info("textual inversion: tokens %s added to tokenizer %d as ids %s", self.strings, i + 1, ids)
        self.module = nn.ParameterDict(params)
        for i, key in enumerate(keys):
            install_rows(components.text_encoders[i], self.token_ids[i][0], lambda key=key: self.module[key])
        self.trained_encoders = frozenset(range(len(keys)))
        self.train_text_encoder = True
        spelled = " ".join(self.strings)
        # sd-scripts' prompt replacement: a multi-vector token in a sample prompt is spelled out, as in captions
        self.prompt_replacements = ((opts.token_string, spelled),) if n > 1 else ()

    def parameter_groups(self, default_lr):
        return [{"params": list(self.module.parameters()), "lr": default_lr}], ["textual_inversion"]

    def shape_settings(self):
        return {"token_string": self.opts.token_string, "num_vectors_per_token": len(self.strings)}

    def file_path(self, output_dir, stem):
        return ckpt.model_path(output_dir, stem, self.save_model_as)

    def embeddings(self) -> dict[str, torch.Tensor]:
        """The file's tensors: the trained vectors, in the save precision."""
        dtype = SAVE_DTYPES[self.save_precision]
        return {key: p.detach().to("cpu", dtype or p.dtype).clone() for key, p in self.module.items()}

    def save(self, path, metadata):
        write_embedding_file(path, self.embeddings(), metadata)


def load_embeddings(family: ModelFamily, components: Components, paths: list[str]) -> tuple[tuple[str, str], ...]:
    """--embeddings (LoRA training) and tools/generate.py: add each embedding file to the loaded model, frozen, under
    its token (the one it records, else its file name), so that the token works in captions and prompts. Returns
    the (token, its vectors spelled out) pairs of multi-vector tokens, for the captions and prompts."""
    keys = family.textual_inversion_keys
    if not keys:
        raise ConfigError(f"--embeddings: textual-inversion embeddings are not available for {family.name}")
    n = len(keys)
    components.tokenizers[:n] = [copy.deepcopy(t) for t in components.tokenizers[:n]]  # see TextualInversionTrainable
    out = []
    for path in paths:
        token, strings = load_embedding_into(components.tokenizers[:n], components.text_encoders[:n], keys, path)
        logger.info("embedding %s loaded as the token %s (%d vector(s))", path, token, len(strings))
        if len(strings) > 1:
            out.append((token, " ".join(strings)))
    return tuple(out)
