"""The flags of train_textual_inversion.py / sdxl_train_textual_inversion.py (sd-scripts' names) and their typed form."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from library.cli.fine_tune import MetadataFlags, metadata_from_args
from library.cli.options import at_least, flag
from library.core.errors import ConfigError
from library.train.settings import TextualInversionOptions


@dataclass
class TextualInversionFlags:
    """What a textual-inversion run trains: the new token's vectors."""
    flag_group: ClassVar[str] = "textual inversion"
    token_string: Optional[str] = flag(None, "the new token trained (required): a string the tokenizer does not have;"
                                             " with N vectors the tokens TOKEN, TOKEN1 .. TOKEN<N-1> are added, and "
                                             "TOKEN in captions and sample prompts stands for all of them")
    init_word: Optional[str] = flag(None, "word(s) whose embedding the vectors start from (one token per vector, "
                                          "repeated when fewer; default: the mean of the token table)")
    num_vectors_per_token: int = flag(1, "vectors of the token's embedding", range=at_least(1))
    use_object_template: bool = flag(False, "ignore the captions: train on sd-scripts' object templates (\"a photo "
                                            "of a TOKEN\", ...), one drawn per sample")
    use_style_template: bool = flag(False, "ignore the captions: train on sd-scripts' style templates (\"a painting "
                                           "in the style of TOKEN\", ...), one drawn per sample")
    weights: Optional[str] = flag(None, "embedding file to continue from (.safetensors as written here or by "
                                        "sd-scripts; A1111 .pt; diffusers .bin); its vector count must be "
                                        "--num_vectors_per_token")
    metadata: MetadataFlags = field(default_factory=MetadataFlags)  # modelspec.* (sd-scripts takes them here too)


def textual_inversion_options_from_args(ns: argparse.Namespace) -> TextualInversionOptions:
    """TextualInversionOptions, checked before anything loads."""
    token = ns.token_string
    if not token or not token.strip():
        raise ConfigError("--token_string: required (the new token to train, e.g. --token_string mychar4)")
    if token != token.strip() or " " in token:
        raise ConfigError(f"--token_string {token!r}: one word without spaces")
    if ns.use_object_template and ns.use_style_template:
        raise ConfigError("--use_object_template with --use_style_template: choose one")
    if ns.weights and not os.path.isfile(ns.weights):
        raise ConfigError(f"--weights {ns.weights}: no such embedding file")
    if ns.init_word is not None and not ns.init_word.strip():
        raise ConfigError("--init_word: empty; give a word or leave the flag out")
    return TextualInversionOptions(token_string=token, init_word=ns.init_word,
                                   num_vectors_per_token=ns.num_vectors_per_token,
                                   use_object_template=bool(ns.use_object_template),
                                   use_style_template=bool(ns.use_style_template), weights=ns.weights,
                                   metadata=metadata_from_args(ns))
