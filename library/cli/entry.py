"""What a training entry script does: parse flags, build settings, run, and turn errors into one line."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import Optional, Sequence

from library.cli.config_file import (
    flag_values,
    parse_with_config_file,
    write_config_file,
)
from library.cli.controlnet import controlnet_options_from_args
from library.cli.dataset import data_options_from_args
from library.cli.fine_tune import ema_options_from_args, fine_tune_options_from_args
from library.cli.memory import gradient_checkpointing_wanted, memory_options_from_args, speed_options_from_args
from library.cli.model import load_options_from_args, text_options_from_args
from library.cli.network import network_options_from_args
from library.cli.noise_loss import loss_options_from_args, noise_options_from_args
from library.cli.optimizer import (
    optimizer_options_from_args,
    scheduler_options_from_args,
)
from library.cli.options import options_from_namespace
from library.cli.parser import build_parser
from library.cli.preflight import check_output_folders
from library.cli.ranges import check_ranges, check_resolution_steps
from library.cli.sampling import sampling_hook_from_args
from library.cli.text_cache import text_cache_options_from_args
from library.cli.textual_inversion import textual_inversion_options_from_args
from library.cli.training import note_compatibility_flags, training_options_from_args
from library.core.errors import ConfigError, UserError
from library.core.metadata import RECORDED_FLAGS
from library.data.building import check_datasets
from library.data.plan import DataFamilyInfo
from library.families import get_family
from library.families.base import ModelFamily
from library.train.adapters.network_kinds import network_kind
from library.train.dreambooth import StopTextEncoderTraining
from library.train.optim.optimizers import optimizer_class
from library.train.settings import RunSettings
from library.train.stopping import StopHandler, StopRequested
from library.train.trainer import InterruptedTraining, Trainer


def setup_logging() -> None:
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "INFO"), format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def configure_console_logging(level: Optional[str], path: Optional[str], simple: bool) -> None:
    """--console_log_level / --console_log_file / --console_log_simple (sd-scripts' names): the root logger's level,
    a file that gets the same messages (appended; a folder that does not exist stops here), and plain messages."""
    if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ConfigError(f"--console_log_file {path}: its folder does not exist")
    root = logging.getLogger()
    if level:
        root.setLevel(level)
    if simple:
        for handler in root.handlers:
            handler.setFormatter(logging.Formatter("%(message)s"))
    if path and not any(getattr(h, "console_log_file", None) == os.path.abspath(path) for h in root.handlers):
        handler = logging.FileHandler(path, encoding="utf-8")
        handler.console_log_file = os.path.abspath(path)
        handler.setFormatter(logging.Formatter("%(message)s" if simple else
                                               "%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)


def settings_from_args(ns: argparse.Namespace, family: ModelFamily, fine_tune: bool = False,
                       textual_inversion: bool = False, controlnet: bool = False) -> RunSettings:
    """Translate the namespace into RunSettings, each concern through its own from_args function.

    Every flag is checked here, before the dataset scan and before any model loads; the namespace
    itself goes no further than this function. `fine_tune`: the namespace is a fine-tune script's;
    `textual_inversion`: a textual-inversion script's.
    """
    check_ranges(vars(ns))  # every numeric flag, before anything else reads it
    ti = None
    if textual_inversion:
        if not family.textual_inversion_keys:
            raise ConfigError(f"textual inversion: not available for {family.name}")
        ti = textual_inversion_options_from_args(ns)
        if not ns.output_name:  # sd-scripts names the embedding after the token
            ns.output_name = ti.token_string
    configure_console_logging(ns.console_log_level, ns.console_log_file, ns.console_log_simple)
    note_compatibility_flags(vars(ns))
    check_resolution_steps(ns.resolution, ns.enable_bucket, family.bucket_reso_multiple)
    family_options = options_from_namespace(family.options_type, ns)
    model = load_options_from_args(ns, family_options)
    memory = memory_options_from_args(vars(ns), family, fine_tune)
    noise = noise_options_from_args(ns)
    family.check_options(family_options, model, blocks_to_swap=memory.blocks_to_swap, min_timestep=noise.min_timestep,
                         max_timestep=noise.max_timestep, zero_terminal_snr=bool(ns.zero_terminal_snr))
    gradient_checkpointing = gradient_checkpointing_wanted(memory, ns.gradient_checkpointing)
    training = training_options_from_args(ns, gradient_checkpointing)
    if model.from_scratch:  # a drawn --seed also seeds the from-scratch initialisation
        model = dataclasses.replace(model, init_seed=training.seed)
    optimizer = optimizer_options_from_args(ns)
    optimizer_class(optimizer)  # a missing optimizer package is reported before data and model load
    network = None if fine_tune or textual_inversion else network_options_from_args(ns)
    if not fine_tune and getattr(family_options, "num_last_block_to_freeze", None):
        raise ConfigError("--num_last_block_to_freeze: a full fine-tune flag (sd3_train.py); a LoRA trains no block "
                          "weights to freeze")
    text_cache = text_cache_options_from_args(ns)
    if ns.weighted_captions and not family.supports_weighted_captions:
        raise ConfigError(f"--weighted_captions: not supported for {family.name} (sd-scripts takes it for SD 1.x/2.x "
                          "and SDXL only); drop the flag")
    if ns.weighted_captions and text_cache.enabled:
        raise ConfigError("--weighted_captions with --cache_text_encoder_outputs: the cache holds unweighted outputs "
                          "(as sd-scripts refuses); drop one")
    network = unet_only_when_caching(network, text_cache.enabled, family)
    if network and network.network_module != "networks.lora" and family.external_networks_unsupported:
        raise ConfigError(f"--network_module {network.network_module}: not supported for {family.name}: "
                          f"{family.external_networks_unsupported}")
    # A drawn seed and implied checkpointing are what the data layer and the metadata must see.
    resolved = {"seed": training.seed, "gradient_checkpointing": gradient_checkpointing,
                "learning_rate": optimizer.learning_rate}
    recorded = {**vars(ns), **resolved}
    kind = network_kind(network.network_module) if network else None
    data = data_options_from_args(ns, seed=training.seed)
    if kind is not None and kind.conditioning_images:  # ControlNet-LLLite: conditioning_data_dir pairs each image
        data = dataclasses.replace(data, conditioning_images=True)
    settings = RunSettings(
        model=model,
        data=data,
        network=network,
        network_kind=kind,
        fine_tune=fine_tune_options_from_args(ns, family) if fine_tune else None,
        textual_inversion=ti,
        ema=ema_options_from_args(ns),
        optimizer=optimizer,
        scheduler=scheduler_options_from_args(ns),
        noise=noise,
        loss=loss_options_from_args(ns),
        training=training,
        text=text_options_from_args(ns),
        text_cache=text_cache,
        memory=memory,
        speed=speed_options_from_args(vars(ns)),
        zero_terminal_snr=bool(ns.zero_terminal_snr),
        no_half_vae=bool(ns.no_half_vae),
        recorded_flags={name: recorded.get(name) for name in RECORDED_FLAGS},
        flags={**flag_values(ns), **resolved},
    )
    if controlnet:  # the ControlNet scripts: a ControlNet trains, the model is frozen; the data pairs images
        if "controlnet" not in family.scripts:
            raise ConfigError(f"ControlNet training is not supported for {family.name}")
        settings.controlnet = controlnet_options_from_args(ns)
        settings.data = dataclasses.replace(settings.data, conditioning_images=True)
    stop_te = getattr(ns, "stop_text_encoder_training", None)  # train_db.py
    if fine_tune and stop_te is not None and stop_te > 0:
        settings.hooks.append(StopTextEncoderTraining(stop_te))
    sample_hook = sampling_hook_from_args(ns)  # reads and checks the prompt file now, before any training
    if sample_hook is not None:
        if type(family).generate is ModelFamily.generate:
            raise ConfigError(f"--sample_prompts: sampling is not implemented for the {family.name} family yet; "
                              "drop the flag (or generate afterwards with tools/generate.py)")
        settings.hooks.append(sample_hook)
        missing = [p.control_image for p in sample_hook.prompts if p.control_image and not os.path.isfile(p.control_image)]
        if controlnet and missing:  # a --cn image is read only where a ControlNet trains (sd-scripts)
            raise ConfigError(f"--sample_prompts: --cn {missing[0]}: file not found")
    return settings


def family_for(ns: argparse.Namespace, family: ModelFamily) -> ModelFamily:
    """The family the parsed flags select (flux_train_network.py --model_type chroma: Chroma)."""
    return family.variant(options_from_namespace(family.options_type, ns))


def unet_only_when_caching(network, caching: bool, family: ModelFamily):
    """--cache_text_encoder_outputs on a family whose cache needs every text encoder frozen (SDXL): train only
    the UNet, as sd-scripts requires with --network_train_unet_only, and say so once. Kept as given when
    text-encoder training was asked for (--text_encoder_lr: then the cache is refused before the scan) or when
    the family caches the frozen encoders while others train (FLUX.1: CLIP-L trains, T5 is cached)."""
    if network is None or not caching or not network.train_text_encoder or not network.train_unet:
        return network
    if family.text_encoder_outputs or network.text_encoder_lr:
        return network
    logging.getLogger(__name__).info("--cache_text_encoder_outputs: training the UNet only (the text encoders "
                                     "are frozen so that their outputs can be cached; as --network_train_unet_only)")
    return dataclasses.replace(network, train_text_encoder=False)


def run_training(family_name: str, description: str, argv: Optional[Sequence[str]] = None,
                 fine_tune: bool = False, dreambooth: bool = False, textual_inversion: bool = False,
                 controlnet: bool = False, lllite: bool = False) -> int:
    """Entry point shared by every training script (LoRA, or with `fine_tune` a full fine-tune; `dreambooth`:
    train_db.py, a fine-tune with its DreamBooth flags; `textual_inversion`: train_textual_inversion.py, new token
    embeddings; `controlnet`: the ControlNet scripts, a fine-tune run that trains a ControlNet; `lllite`:
    sdxl_train_control_net_lllite.py, a network run of networks.control_net_lllite with --cond_emb_dim). Returns
    the exit code."""
    setup_logging()
    stop = StopHandler()
    try:
        # From here on a signal stops cleanly, also while loading and caching; one that came while the entry
        # script imported (library/core/stop_signals.py recorded it) stops here.
        stop.install()
        return _run(family_name, description, argv, stop, fine_tune or controlnet, dreambooth,
                    textual_inversion=textual_inversion, controlnet=controlnet, lllite=lllite)
    except StopRequested as e:
        print(str(e), file=sys.stderr)
        return 128 + int(e.signum)
    finally:
        stop.uninstall()


def _run(family_name: str, description: str, argv: Optional[Sequence[str]], stop: StopHandler,
         fine_tune: bool, dreambooth: bool = False, *, textual_inversion: bool = False, controlnet: bool = False,
         lllite: bool = False) -> int:
    family = get_family(family_name)
    parser = build_parser(description, family, fine_tune, dreambooth, textual_inversion=textual_inversion,
                          controlnet=controlnet, lllite=lllite)
    try:
        ns = parse_with_config_file(parser, argv)
        family = family_for(ns, family)
        settings = settings_from_args(ns, family, fine_tune, textual_inversion=textual_inversion,
                                      controlnet=controlnet)
        if ns.check_config:  # the web UI's validation: the same checks and one-line errors as a run
            # the dataset TOML's keys and values, and its buckets against the resolution (no image is read)
            check_datasets(settings.data, DataFamilyInfo.from_family(family, settings.model.family_options))
            print("config ok")
            return 0
        if os.environ.get("RANK", "0") == "0":  # only the main process writes (RANK: set by torchrun / accelerate)
            check_output_folders(settings.training)  # before the dataset scan and the model load
        if ns.debug_dataset:  # print the batches and stop: nothing loads, nothing trains
            Trainer(family, settings, stop).debug_dataset()
            return 0
        config_path = os.path.join(settings.training.output_dir, f"{settings.training.output_name}_config.toml")

        def write_config(trainer, event: str, step: int) -> None:  # once every check has passed
            if event == "train_start" and trainer.accelerator.is_main_process:
                write_config_file(ns, config_path, parser)

        settings.hooks.insert(0, write_config)
        path = Trainer(family, settings, stop).run()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except InterruptedTraining as e:
        print(str(e), file=sys.stderr)
        return 128 + int(e.signum)
    print(f"saved {path}")
    return 0

