"""Component-file flags for the tools: FLUX.1's --clip_l / --t5xxl / --ae (FluxOptions), Anima's --qwen3 /
--llm_adapter_path / --t5_tokenizer_path (AnimaOptions), SD3's --clip_g (SD3Options; with --clip_l / --t5xxl),
Lumina's --gemma2 (LuminaOptions; with --ae), HunyuanImage's --text_encoder / --byt5 (HunyuanImageOptions; with --vae).

The training scripts get every FluxOptions flag through the family's options_type (library/cli/parser.py).
"""

from __future__ import annotations

import argparse
from typing import Optional

from library.cli.options import add_option_arguments
from library.families.anima.options import COMPONENT_FILE_FLAGS as ANIMA_FILE_FLAGS
from library.families.anima.options import AnimaOptions
from library.families.flux.options import COMPONENT_FILE_FLAGS, FluxOptions
from library.families.hunyuan_image.options import COMPONENT_FILE_FLAGS as HUNYUAN_IMAGE_FILE_FLAGS
from library.families.hunyuan_image.options import HunyuanImageOptions
from library.families.lumina.options import LuminaOptions
from library.families.sd3.options import SD3Options

TOOL_FILE_FLAGS = (*COMPONENT_FILE_FLAGS, "clip_g", "gemma2", *HUNYUAN_IMAGE_FILE_FLAGS)


def add_component_file_arguments(group) -> None:
    """--clip_l / --t5xxl / --ae: the parts a BFL single-file transformer does not hold; --clip_g with
    --clip_l / --t5xxl: the text encoders an SD3 MMDiT + VAE file does not hold."""
    add_option_arguments(group, FluxOptions, only=COMPONENT_FILE_FLAGS)
    add_option_arguments(group, AnimaOptions, only=ANIMA_FILE_FLAGS)  # Anima: --qwen3, --llm_adapter_path, ...
    add_option_arguments(group, SD3Options, only=("clip_g",))
    add_option_arguments(group, LuminaOptions, only=("gemma2",))  # Lumina: Gemma-2 (with --ae, FLUX.1's AE)
    add_option_arguments(group, HunyuanImageOptions, only=HUNYUAN_IMAGE_FILE_FLAGS)  # Qwen2.5-VL, glyph byT5


def component_files(ns: argparse.Namespace) -> dict[str, Optional[str]]:
    """The component-file flags of a parsed namespace (values for library.cli.options.options_from_values)."""
    return {name: getattr(ns, name, None) for name in TOOL_FILE_FLAGS + ANIMA_FILE_FLAGS}
