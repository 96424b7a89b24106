"""The full argument parser of a LoRA training script, assembled from one module per concern."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from typing import NoReturn, Optional

from library.cli.config_file import ConfigFileFlags
from library.cli.controlnet import ControlNetFlags, FluxControlNetFlags
from library.cli.dataset import DatasetFlags
from library.cli.deepspeed import DeepSpeedFlags
from library.cli.fine_tune import MODEL_FORMATS, DreamBoothFlags, EmaFlags, FineTuneFlags, T5xxlFineTuneFlags
from library.cli.memory import MemoryFlags, SpeedFlags
from library.cli.model import ModelFlags
from library.cli.network import LLLiteFlags, NetworkFlags
from library.cli.noise_loss import LossFlags, NoiseFlags, NoiseSchedulerFlags
from library.cli.optimizer import OptimizerFlags, SchedulerFlags
from library.cli.options import FlagSpec, Range, add_flags, at_least, flag_specs
from library.cli.sampling import SamplingFlags
from library.cli.text_cache import TextCacheFlags
from library.cli.textual_inversion import TextualInversionFlags
from library.cli.training import TRAINING_FLAG_GROUPS
from library.families.base import ModelFamily
from library.families.common.controlnet import CONTROLNET_FORMATS

# The flag groups of a training script, in --help order; the trained part (NetworkFlags or FineTuneFlags) is third.
_BEFORE_TRAINED = (ConfigFileFlags, ModelFlags, DatasetFlags)
_AFTER_TRAINED = (EmaFlags, OptimizerFlags, SchedulerFlags, NoiseFlags, NoiseSchedulerFlags, LossFlags,
                  *TRAINING_FLAG_GROUPS, DeepSpeedFlags, MemoryFlags, SpeedFlags, SamplingFlags)
# Every flag group declared in library/cli (library/cli/ranges.py collects their ranges).
CORE_FLAG_GROUPS = (*_BEFORE_TRAINED, NetworkFlags, FineTuneFlags, *_AFTER_TRAINED, TextCacheFlags,
                    T5xxlFineTuneFlags, DreamBoothFlags, TextualInversionFlags, ControlNetFlags, FluxControlNetFlags,
                    LLLiteFlags)


# The ranges of flags declared outside library/cli (a family's options, the flow-matching scheme), by name; every
# other flag declares its range with itself (the "range" of its field, library/cli/options.py).
FAMILY_FLAG_RANGES: dict[str, Range] = {
    # FLUX.1 and flow matching
    "guidance_scale": Range(lo=0), "t5xxl_max_token_length": at_least(1), "sigmoid_scale": Range(lo=0, lo_open=True),
    "discrete_flow_shift": Range(lo=0, lo_open=True), "logit_mean": Range(), "logit_std": Range(lo=0, lo_open=True),
    "mode_scale": Range(),
    # SD3
    "num_last_block_to_freeze": at_least(1),
}


class TrainingArgumentParser(argparse.ArgumentParser):
    """argparse as sd-scripts uses it (unambiguous abbreviations such as --network_di are accepted), but a bad
    command line is one line on stderr, with the closest flag names for an unknown one, and exit code 2:
    no usage dump of every flag (--help prints that)."""

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(self.unknown_arguments_message(extras))
        return ns

    def flag_names(self) -> list[str]:
        return sorted({o for a in self._actions for o in a.option_strings if o.startswith("--")})

    def suggestions(self, flag: str, n: int = 3) -> list[str]:
        """The closest long flag names to `flag` (which may be written --flag=value)."""
        name = flag.split("=", 1)[0]
        close = difflib.get_close_matches(name, self.flag_names(), n=n, cutoff=0.6)
        ratio = lambda other: difflib.SequenceMatcher(None, name, other).ratio()  # noqa: E731
        return [c for c in close if ratio(c) >= ratio(close[0]) - 0.05]  # only the near-equal best ones

    def unknown_arguments_message(self, extras: list[str]) -> str:
        flags = [e for e in extras if e.startswith("-")]
        if not flags:
            return f"unexpected value{'s' if len(extras) > 1 else ''} {' '.join(extras)} (a value without a flag)"
        parts = []
        for flag in flags:
            close = self.suggestions(flag)
            hint = f"; did you mean {' or '.join(close)}?" if close else " (--help lists every flag)"
            parts.append(f"{flag.split('=', 1)[0]}{hint}")
        return f"unrecognized argument{'s' if len(flags) > 1 else ''} " + "; ".join(parts)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}\n")

    def exit(self, status: int = 0, message=None) -> NoReturn:
        if message:
            sys.stderr.write(message)
        raise SystemExit(status)


def training_flags(family: Optional[ModelFamily] = None, fine_tune: bool = False,
                   dreambooth: bool = False, textual_inversion: bool = False, controlnet: bool = False,
                   lllite: bool = False) -> list[FlagSpec]:
    """Every flag of a training script (a LoRA one, or with `fine_tune` a full fine-tune) of `family`, in --help
    order: the core groups, then the family's own options and, where it has them, the text-encoder cache and
    T5-XXL fine-tuning flags; `dreambooth` (train_db.py, a fine-tune) adds its DreamBooth flags, `controlnet` (the
    ControlNet scripts, fine-tune scripts that train a ControlNet) the ControlNet ones,
    `lllite` (sdxl_train_control_net_lllite.py, a network run) --cond_emb_dim.
    `textual_inversion` (train_textual_inversion.py): its flags in place of the network's, no text-encoder cache
    (the encoders' outputs depend on the trained vectors)."""
    if textual_inversion:
        groups = (*_BEFORE_TRAINED, TextualInversionFlags, *_AFTER_TRAINED)
        specs = [spec for cls in groups for spec in flag_specs(cls)]
        if family is not None and dataclasses.fields(family.options_type):
            specs += [dataclasses.replace(spec, range=FAMILY_FLAG_RANGES.get(spec.name))
                      for spec in flag_specs(family.options_type, f"{family.name} model", declared_defaults=False)]
        return [_as_textual_inversion(spec) for spec in specs]
    control = (ControlNetFlags, *((FluxControlNetFlags,) if family is not None and family.controlnet_block_flags else ()))
    groups = (*_BEFORE_TRAINED, FineTuneFlags if fine_tune else NetworkFlags, *_AFTER_TRAINED,
              *((DreamBoothFlags,) if dreambooth and fine_tune else ()),
              *(control if controlnet and fine_tune else ()),
              *((LLLiteFlags,) if lllite and not fine_tune else ()))
    specs = [spec for cls in groups for spec in flag_specs(cls)]
    if family is not None:
        if dataclasses.fields(family.options_type):  # declared in library/families: their ranges are listed apart
            specs += [dataclasses.replace(spec, range=FAMILY_FLAG_RANGES.get(spec.name))
                      for spec in flag_specs(family.options_type, f"{family.name} model", declared_defaults=False)]
        if family.supports_text_cache:
            specs += flag_specs(TextCacheFlags)
    if fine_tune:
        if getattr(family, "fine_tune_t5xxl_encoder", None) is not None:
            specs += flag_specs(T5xxlFineTuneFlags)
        specs = [_as_fine_tune(spec, family, controlnet) for spec in specs]
    return specs


def _as_textual_inversion(spec: FlagSpec) -> FlagSpec:
    """An embedding is saved as one small file (sd-scripts' formats); it is named after the token by default."""
    if spec.name == "save_model_as":
        return dataclasses.replace(spec, choices=("safetensors", "pt", "ckpt"),
                                   help="format of saved embeddings: safetensors, or pt / ckpt (torch.save of the same "
                                        "dict)")
    if spec.name == "output_name":
        return dataclasses.replace(spec, help="base file name of the saved embedding (default: --token_string)")
    return spec


def _as_fine_tune(spec: FlagSpec, family: Optional[ModelFamily], controlnet: bool = False) -> FlagSpec:
    """A full fine-tune saves the model itself, in the family's own formats (a wrong one stops before training)."""
    if spec.name == "save_model_as" and controlnet:
        return dataclasses.replace(spec, choices=CONTROLNET_FORMATS,
                                   help="format of the saved ControlNet: one .safetensors file (diffusers names, "
                                        "as ComfyUI loads it) or a diffusers folder")
    if spec.name == "save_model_as":
        return dataclasses.replace(spec, choices=tuple(getattr(family, "save_formats", MODEL_FORMATS)),
                                   help="format of saved models: single-file ckpt/safetensors (original layout) or a "
                                        "diffusers folder")
    if spec.name in ("full_fp16", "full_bf16"):
        return dataclasses.replace(spec, help=spec.help.replace("the network itself", "the model's weights themselves"))
    return spec


def build_parser(description: str, family: Optional[ModelFamily] = None,
                 fine_tune: bool = False, dreambooth: bool = False, *, textual_inversion: bool = False,
                 controlnet: bool = False, lllite: bool = False) -> TrainingArgumentParser:
    """The parser of a training script; it keeps its flags (`flag_specs`), family and mode for --describe_flags."""
    parser = TrainingArgumentParser(description=description, allow_abbrev=True)
    parser.flag_specs = training_flags(family, fine_tune, dreambooth, textual_inversion=textual_inversion,
                                       controlnet=controlnet, lllite=lllite)
    parser.family = family
    parser.fine_tune = fine_tune
    parser.mode = "textual_inversion" if textual_inversion else "fine_tune" if fine_tune else "lora"
    add_flags(parser, parser.flag_specs)
    return parser

