"""Flags of a full fine-tune (fine_tune.py, sdxl_train.py, flux_train.py) and of EMA, and their typed forms."""

from __future__ import annotations

import argparse

from library.core.errors import ConfigError
from library.train.settings import EmaOptions, FineTuneOptions

MODEL_FORMATS = ["ckpt", "safetensors", "diffusers", "diffusers_safetensors"]
METADATA_FLAGS = ("metadata_title", "metadata_author", "metadata_description", "metadata_license", "metadata_tags")


def add_metadata_arguments(g) -> None:
    """--metadata_* (modelspec.*), shared by LoRA and full-model training."""
    g.add_argument("--metadata_title", type=str, default=None, help="modelspec.title (default: output name)")
    g.add_argument("--metadata_author", type=str, default=None, help="modelspec.author")
    g.add_argument("--metadata_description", type=str, default=None, help="modelspec.description")
    g.add_argument("--metadata_license", type=str, default=None, help="modelspec.license")
    g.add_argument("--metadata_tags", type=str, default=None, help="modelspec.tags (comma-separated)")


def add_fine_tune_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fine-tuning")
    g.add_argument("--train_text_encoder", action="store_true",
                   help="also train the text encoder(s); each trains unless its learning rate is 0")
    g.add_argument("--learning_rate_te", type=float, default=None,
                   help="learning rate of every text encoder (default: --learning_rate)")
    g.add_argument("--learning_rate_te1", type=float, default=None,
                   help="learning rate of the first text encoder (SDXL: CLIP-L); overrides --learning_rate_te")
    g.add_argument("--learning_rate_te2", type=float, default=None,
                   help="learning rate of the second text encoder (SDXL: OpenCLIP-G); overrides --learning_rate_te")
    g.add_argument("--block_lr", type=str, default=None,
                   help="comma-separated learning rates, one per UNet block (SDXL: 23 values: embeddings, IN00-IN08, "
                        "MID0-MID2, OUT00-OUT08, out); 0 freezes that block")
    g.add_argument("--mem_eff_save", action="store_true",
                   help="write checkpoints tensor by tensor, without a second copy of the model in memory")
    g.add_argument("--fused_optimizer_groups", type=int, default=None,
                   help="cut the parameters into N groups, each stepped (and its gradients freed) as soon as all "
                        "of its gradients are in: like --fused_backward_pass with N optimizers")
    g.add_argument("--blockwise_fused_optimizers", action="store_true",
                   help="FLUX.1: one optimizer per transformer block (each double block, each single block, the "
                        "rest), stepped during backward as soon as its block's gradients are in")
    g.add_argument("--fused_backward_pass", action="store_true",
                   help="step each parameter as soon as its gradient is complete: the gradients of the whole "
                        "model are never held at once (no gradient accumulation)")
    add_metadata_arguments(g)


def add_t5xxl_fine_tune_arguments(parser: argparse.ArgumentParser) -> None:
    """sd3_train.py's --train_t5xxl and --learning_rate_te3 (a family with a fine_tune_t5xxl_encoder)."""
    g = parser.add_argument_group("fine-tuning T5-XXL")
    g.add_argument("--train_t5xxl", action="store_true",
                   help="with --train_text_encoder, train T5-XXL too (its outputs cannot be cached then)")
    g.add_argument("--learning_rate_te3", type=float, default=None,
                   help="learning rate of T5-XXL with --train_t5xxl (default: --learning_rate_te, else --learning_rate; "
                        "0 keeps it frozen)")


def add_ema_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("EMA (moving average of the trained weights)")
    g.add_argument("--use_ema", action="store_true", help="keep an EMA of the trained weights and save it")
    g.add_argument("--ema_decay", type=float, default=0.9999, help="EMA decay (default 0.9999)")
    g.add_argument("--ema_no_warmup", action="store_true",
                   help="use --ema_decay from the first update (default: min(decay, (1+t)/(10+t)) at update t)")
    g.add_argument("--ema_update_every", type=int, default=1, help="update the EMA every N optimizer steps")
    g.add_argument("--ema_device", type=str, default="cpu", choices=["cpu", "same"],
                   help="where the EMA weights live: cpu (default) or the training device")
    g.add_argument("--ema_start_step", type=int, default=0, help="start the EMA at this optimizer step")
    g.add_argument("--save_ema_only", type=_bool, default=True, metavar="true|false",
                   help="save only the EMA weights (default true); false also saves the trained ones as <name>-nonema")
    g.add_argument("--ema_for_sampling", type=_bool, default=True, metavar="true|false",
                   help="sample images with the EMA weights (default true)")
    g.add_argument("--ema_for_validation", type=_bool, default=True, metavar="true|false",
                   help="compute the validation loss with the EMA weights (default true)")


def _bool(value: str) -> bool:
    v = str(value).strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def block_lrs_from_args(value, family) -> list[float]:
    """--block_lr "a,b,...": one finite rate >= 0 per block of the family's layout."""
    if not value:
        return []
    layout = family.lora_block_layout()
    if layout is None:
        raise ConfigError(f"--block_lr: {family.name} has no UNet block layout; it is for SDXL")
    try:
        rates = [float(v) for v in str(value).split(",")]
    except ValueError:
        raise ConfigError(f"--block_lr {value}: expected {layout.num_blocks} comma-separated numbers") from None
    if len(rates) != layout.num_blocks or any(not (0 <= r < float("inf")) for r in rates):
        raise ConfigError(f"--block_lr: expected {layout.num_blocks} comma-separated rates >= 0 ({layout.names}), "
                          f"got {len(rates)}")
    return rates


def fine_tune_options_from_args(ns: argparse.Namespace, family=None) -> FineTuneOptions:
    chosen = [flag for flag, on in (("--fused_backward_pass", ns.fused_backward_pass),
                                    ("--fused_optimizer_groups", ns.fused_optimizer_groups),
                                    ("--blockwise_fused_optimizers", ns.blockwise_fused_optimizers)) if on]
    if len(chosen) > 1:
        raise ConfigError(f"{chosen[1]}: not with {chosen[0]}; choose one")
    fused = chosen[0] if chosen else None
    # A family with a block layout for it names a block for every parameter; the others name none.
    if ns.blockwise_fused_optimizers and family is not None and family.optimizer_block("") is None:
        raise ConfigError(f"--blockwise_fused_optimizers: not for {family.name}; it groups FLUX.1's double and "
                          "single blocks (use --fused_backward_pass or --fused_optimizer_groups)")
    if fused and ns.gradient_accumulation_steps > 1:
        raise ConfigError(f"{fused}: gradients are applied during backward, so it cannot accumulate "
                          f"them; drop --gradient_accumulation_steps {ns.gradient_accumulation_steps}")
    if fused and ns.mixed_precision == "fp16" and not ns.full_fp16:
        raise ConfigError(f"{fused}: not with --mixed_precision fp16 (loss scaling must see every "
                          "gradient before a step); use bf16, or --full_fp16")
    for flag in ("fp8_base", "fp8_base_unet"):
        if getattr(ns, flag, False):
            raise ConfigError(f"--{flag}: float8 weights cannot be trained; it is for LoRA training only")
    train_t5xxl = bool(getattr(ns, "train_t5xxl", False))
    if train_t5xxl and not ns.train_text_encoder:
        raise ConfigError("--train_t5xxl: needs --train_text_encoder (CLIP-L and CLIP-G train with T5-XXL, as in "
                          "sd-scripts)")
    if train_t5xxl and (ns.cache_text_encoder_outputs or getattr(ns, "cache_text_encoder_outputs_to_disk", False)):
        raise ConfigError("--train_t5xxl: T5-XXL's outputs cannot be cached while it trains; drop "
                          "--cache_text_encoder_outputs")
    te3 = getattr(ns, "learning_rate_te3", None)
    if te3 is not None and not train_t5xxl:
        raise ConfigError("--learning_rate_te3: T5-XXL trains only with --train_t5xxl; add it or drop the rate")
    return FineTuneOptions(train_text_encoder=bool(ns.train_text_encoder), learning_rate_te=ns.learning_rate_te,
                           learning_rate_te_each=[ns.learning_rate_te1, ns.learning_rate_te2, te3],
                           train_t5xxl=train_t5xxl,
                           mem_eff_save=bool(ns.mem_eff_save), block_lr=block_lrs_from_args(ns.block_lr, family),
                           fused_backward_pass=bool(ns.fused_backward_pass),
                           fused_optimizer_groups=ns.fused_optimizer_groups,
                           blockwise_fused_optimizers=bool(ns.blockwise_fused_optimizers),
                           metadata={k: getattr(ns, k, None) for k in METADATA_FLAGS})


# The --ema_* flags and their defaults: one given with another value without --use_ema would change nothing.
EMA_FLAG_DEFAULTS = {"ema_decay": 0.9999, "ema_no_warmup": False, "ema_update_every": 1, "ema_device": "cpu",
                     "ema_start_step": 0, "save_ema_only": True, "ema_for_sampling": True, "ema_for_validation": True}


def ema_options_from_args(ns: argparse.Namespace) -> EmaOptions:
    if not getattr(ns, "use_ema", False):
        for flag, default in EMA_FLAG_DEFAULTS.items():
            if getattr(ns, flag, default) != default:
                raise ConfigError(f"--{flag}: only used with --use_ema; add --use_ema or drop the flag")
        return EmaOptions()
    if not 0.0 < ns.ema_decay < 1.0:
        raise ConfigError(f"--ema_decay: expected a number between 0 and 1, got {ns.ema_decay}")
    if ns.ema_update_every < 1:
        raise ConfigError(f"--ema_update_every: expected an integer >= 1, got {ns.ema_update_every}")
    if ns.ema_start_step < 0:
        raise ConfigError(f"--ema_start_step: expected an integer >= 0, got {ns.ema_start_step}")
    return EmaOptions(use_ema=True, decay=ns.ema_decay, warmup=not ns.ema_no_warmup,
                      update_every=ns.ema_update_every, device=ns.ema_device, start_step=ns.ema_start_step,
                      save_ema_only=ns.save_ema_only, for_sampling=ns.ema_for_sampling,
                      for_validation=ns.ema_for_validation)
