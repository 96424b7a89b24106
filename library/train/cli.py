"""What a training entry script does: parse flags, build settings, run, and turn errors into one line."""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional, Sequence

from library.errors import UserError


def _setup_logging() -> None:
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "INFO"), format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def settings_from_args(ns, family, parser):
    """Translate the namespace into RunSettings: each concern through its own from_args function."""
    from library.args.config_file import config_values
    from library.args.dataset import data_options_from_args
    from library.args.memory import gradient_checkpointing_wanted, memory_options_from_args
    from library.args.model import load_options_from_args
    from library.args.network import import_network_module, network_options_from_args
    from library.args.noise_loss import loss_options_from_args, noise_options_from_args
    from library.args.optimizer import optimizer_options_from_args, scheduler_options_from_args
    from library.args.training import training_options_from_args
    from library.errors import ConfigError
    from library.train.optimizers import optimizer_class
    from library.train.trainer import RunSettings

    if hasattr(family, "configure_from_args"):  # the family's own flags, checked before any model loads
        family.configure_from_args(dict(vars(ns)))
    memory = memory_options_from_args(vars(ns), family)
    ns.gradient_checkpointing = gradient_checkpointing_wanted(memory, ns.gradient_checkpointing)
    training = training_options_from_args(ns)
    optimizer = optimizer_options_from_args(ns)
    optimizer_class(optimizer)  # a missing optimizer package is reported before data and model load
    ns.seed = training.seed  # a drawn seed is what the data layer and metadata must see
    network = network_options_from_args(ns)
    if network.network_module != "networks.lora" and family.external_networks_unsupported:
        raise ConfigError(f"--network_module {network.network_module}: not supported for {family.name}: "
                          f"{family.external_networks_unsupported}")
    settings = RunSettings(
        model=load_options_from_args(ns),
        clip_skip=ns.clip_skip,
        max_token_length=ns.max_token_length,
        data=data_options_from_args(ns),
        network=network,
        optimizer=optimizer,
        scheduler=scheduler_options_from_args(ns),
        noise=noise_options_from_args(ns),
        loss=loss_options_from_args(ns),
        training=training,
        flags=dict(vars(ns)),
        network_module=import_network_module(network.network_module),
        zero_terminal_snr=ns.zero_terminal_snr,
        no_half_vae=ns.no_half_vae,
        memory=memory,
    )
    settings.flags["_config_values"] = config_values(ns, parser)
    from library.args.sampling import sampling_hook_from_args
    from library.families.base import ModelFamily

    sample_hook = sampling_hook_from_args(ns)  # reads and checks the prompt file now, before any training
    if sample_hook is not None:
        if type(family).generate is ModelFamily.generate:
            raise ConfigError(f"--sample_prompts: sampling is not implemented for the {family.name} family yet; "
                              "drop the flag (or generate afterwards with tools/generate.py)")
        settings.hooks.append(sample_hook)
    return settings


def run_training(family_name: str, description: str, argv: Optional[Sequence[str]] = None) -> int:
    """Entry point shared by train_network.py and the family scripts. Returns the exit code."""
    _setup_logging()
    from library.args.config_file import parse_with_config_file, write_config_file
    from library.families import get_family
    from library.train.trainer import InterruptedTraining, NetworkTrainer

    family = get_family(family_name)
    parser = build_parser(description, family)
    try:
        ns = parse_with_config_file(parser, argv)
        settings = settings_from_args(ns, family, parser)
        config_path = os.path.join(settings.training.output_dir, f"{settings.training.output_name}_config.toml")

        def write_config(trainer, event: str, step: int) -> None:  # once every check has passed
            if event == "train_start":
                write_config_file(ns, config_path, parser)

        settings.hooks.insert(0, write_config)
        path = NetworkTrainer(family, settings).run()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except InterruptedTraining as e:
        print(str(e), file=sys.stderr)
        return 128 + int(e.signum)
    print(f"saved {path}")
    return 0


def build_parser(description: str, family=None):
    from library.args.parser import build_network_training_parser

    return build_network_training_parser(description, family)
