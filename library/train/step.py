"""One forward pass of the denoiser on a batch, and its loss. Shared by training and validation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from library.core.errors import UserError
from library.data.te_cache import cached_conditioning
from library.families.base import Components, ModelFamily, TextConditioning
from library.objectives.losses import LossOptions, training_loss
from library.objectives.noise import NoiseOptions, make_noise, perturb_for_input
from library.objectives.posterior import posterior_generators


@dataclass
class StepContext:
    """Everything a step needs besides the batch; built once by the trainer."""

    family: ModelFamily
    components: Components
    scheme: object  # library.objectives.noise.DDPMScheme or a family's flow scheme
    noise: NoiseOptions
    loss: LossOptions
    device: torch.device
    weight_dtype: torch.dtype
    clip_skip: Optional[int]
    max_token_length: Optional[int]
    train_text_encoder: bool
    autocast: object  # a context-manager factory (accelerator.autocast)
    text_cache: Optional[dict] = None  # caption -> cached encoder outputs (--cache_text_encoder_outputs)
    live_encoders: frozenset = frozenset()  # text encoders run every step beside the cache (they train)
    weighted_captions: bool = False  # --weighted_captions: "(word:1.2)" in captions (family.encode_weighted_captions)
    adapter_off: Optional[Callable] = None  # a LoRA run: a context in which the model predicts without it (DOP)
    fill_text_cache: bool = False  # the automatic cache: text_cache gains a caption the first time a step meets it
    before_predict: Optional[Callable[[dict], None]] = None  # the trainable's look at the batch before the model
    # runs (ControlNet-LLLite: the batch's conditioning images)


def encode_with_vae(family: ModelFamily, vae, images: torch.Tensor) -> torch.Tensor:
    """Unscaled latents of images in [-1, 1], each image's posterior sample drawn from its own seed
    (library/objectives/posterior.py): what caching and training without a cache both encode with."""
    generators = posterior_generators(images)  # from the pixels as loaded, before any cast to the VAE's dtype
    return family.encode_images(vae, images.to(vae.device, vae.dtype), generators)


def batch_latents(ctx: StepContext, batch: dict) -> torch.Tensor:
    """Scaled latents of a batch: from the cache, or encoded now with the VAE (`encode_with_vae`). Edit training:
    the control images' latents likewise, scaled, go to batch["scaled_control_latents"] (the family's predict)."""
    latents = batch.get("latents")
    if latents is None:
        latents = encode_with_vae(ctx.family, ctx.components.vae, batch["images"])
    controls = batch.get("control_latents")
    if controls is None and batch.get("control_images"):
        controls = [encode_with_vae(ctx.family, ctx.components.vae, c) for c in batch["control_images"]]
    if controls:
        batch["scaled_control_latents"] = [ctx.family.scale_latents(c.to(ctx.device, torch.float32)) for c in controls]
    return ctx.family.scale_latents(latents.to(ctx.device, torch.float32))


def encode_captions(ctx: StepContext, captions: list[str], encoders: Optional[frozenset] = None) -> TextConditioning:
    """The text conditioning of `captions`: from every text encoder, or only those numbered in `encoders`."""
    if ctx.weighted_captions:  # never with the text cache (refused before the scan), so all encoders run
        with torch.set_grad_enabled(ctx.train_text_encoder and torch.is_grad_enabled()), ctx.autocast():
            return ctx.family.encode_weighted_captions(ctx.components, captions, ctx.clip_skip, ctx.max_token_length,
                                                       ctx.device)
    tokens = ctx.family.tokenize(ctx.components, captions, ctx.max_token_length)
    tokens = [t.to(ctx.device) for t in tokens]
    with torch.set_grad_enabled(ctx.train_text_encoder and torch.is_grad_enabled()), ctx.autocast():
        if encoders is None:
            return ctx.family.encode_text(ctx.components, tokens, ctx.clip_skip)
        return ctx.family.encode_text_with(ctx.components, tokens, ctx.clip_skip, encoders)


def fill_text_cache(ctx: StepContext, captions: list[str]) -> None:
    """Encode the captions of a batch that ctx.text_cache does not hold yet (together, as the plain step would
    encode them) and keep each one's outputs; the automatic cache of frozen text encoders."""
    missing = [c for c in dict.fromkeys(captions) if c not in ctx.text_cache]
    if missing:
        with torch.no_grad():
            outputs = encode_captions(ctx, missing).tensors
        for i, caption in enumerate(missing):
            ctx.text_cache[caption] = {k: v[i].detach().cpu() for k, v in outputs.items()}  # as the explicit cache


def _draw(ctx: StepContext, latents: torch.Tensor, generator: torch.Generator,
          timesteps: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(noise, timesteps, input noise) for `latents`, drawn from `generator` (timesteps: given ones kept)."""
    noise = make_noise(latents.cpu(), ctx.noise, generator=generator).to(ctx.device)
    if timesteps is None:
        # The latent shape matters to schemes whose timestep density depends on image size (flux_shift).
        bias = ctx.noise.timestep_bias  # passed only when it changes the draw: schemes without it still work
        timesteps = ctx.scheme.sample_timesteps(latents.shape[0], ctx.noise.min_timestep, ctx.noise.max_timestep,
                                                generator=generator, latent_shape=tuple(latents.shape),
                                                **({"bias": bias} if bias is not None and bias.active else {}))
    timesteps = timesteps.to(ctx.device)
    input_noise = perturb_for_input(noise.cpu(), ctx.noise, generator=generator).to(ctx.device)
    return noise, timesteps, input_noise


def text_keys(ctx: StepContext, batch: dict) -> list[str]:
    """What each sample's text conditioning is computed from (family.text_key): its caption, with its control
    images where the family's text encoder reads them (Qwen-Image-Edit); the text cache keys on it."""
    controls = batch.get("control_paths") or [()] * len(batch["captions"])
    return [ctx.family.text_key(ctx.components, c, tuple(p)) for c, p in zip(batch["captions"], controls)]


def batch_loss(ctx: StepContext, batch: dict, generator: torch.Generator,
               timesteps: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, per-sample loss) for one batch. Randomness comes from `generator` (on the CPU)."""
    latents = batch_latents(ctx, batch)
    keys = text_keys(ctx, batch)
    if ctx.fill_text_cache:
        fill_text_cache(ctx, keys)
    if ctx.text_cache is not None:
        text = TextConditioning(cached_conditioning(ctx.text_cache, keys, ctx.device))
        if ctx.live_encoders:  # the text encoders that train: their outputs are fresh every step
            text.tensors.update(encode_captions(ctx, keys, ctx.live_encoders).tensors)
    else:
        text = encode_captions(ctx, keys)
    seeds = batch.get("noise_seeds")
    if timesteps is None and seeds and len(seeds) == latents.shape[0]:
        # Training: each sample's noise and timestep from its own seed (seed, epoch, sample's place in the epoch),
        # so a sample draws the same whatever the batch it shares or the number of processes.
        parts = [_draw(ctx, latents[i:i + 1], torch.Generator("cpu").manual_seed(s), None)
                 for i, s in enumerate(seeds)]
        noise, timesteps, input_noise = (torch.cat(x) for x in zip(*parts))
    else:
        noise, timesteps, input_noise = _draw(ctx, latents, generator, timesteps)
    noisy = ctx.scheme.add_noise(latents, input_noise, timesteps)

    if ctx.before_predict is not None:
        ctx.before_predict(batch)
    with ctx.autocast():
        pred = ctx.family.predict(ctx.components, noisy.to(ctx.weight_dtype), timesteps, text, batch)
    pred = ctx.scheme.prediction(pred.float(), noisy.float(), timesteps)  # flow: raw / additive / sigma_scaled
    target = ctx.scheme.target(latents, noise, timesteps)
    preserve = batch.get("diff_output_preservation")
    if preserve is not None and bool(preserve.any()):
        target = preserved_target(ctx, target, preserve.to(ctx.device), noisy, timesteps, text, batch)

    mask = batch.get("masks")
    if mask is not None:
        mask = mask.to(ctx.device)
    weights = batch["loss_weights"].to(ctx.device, torch.float32)
    weights = weights * ctx.scheme.loss_weights(timesteps).to(weights)  # flow weighting schemes; 1 for DDPM
    # Per-sample masked-training settings of each sample's subset (library/data/loading.py); absent: sd-scripts' rule.
    unmasked = batch.get("mask_unmasked_weights")
    normalize = batch.get("mask_normalize")
    return training_loss(pred.float(), target.float(), timesteps, ctx.scheme, ctx.loss, weights, mask,
                         unmasked if unmasked is not None else 0.0, normalize if normalize is not None else False)


def preserved_target(ctx: StepContext, target: torch.Tensor, preserve: torch.Tensor, noisy: torch.Tensor,
                     timesteps: torch.Tensor, text: TextConditioning, batch: dict) -> torch.Tensor:
    """Differential output preservation (the subset key custom_attributes.diff_output_preservation, as sd-scripts'
    train_network.py): for the marked samples the target is the base model's own prediction (the network at
    multiplier 0) on the same noisy input, timestep and caption, so training on them keeps the model's output for
    their captions (typically the class prompt without the trigger word) unchanged."""
    if ctx.adapter_off is None:
        raise UserError("custom_attributes.diff_output_preservation: only for network (LoRA) training, where the "
                        "base model's prediction is the network at multiplier 0")
    with torch.no_grad(), ctx.adapter_off(), ctx.autocast():
        prior = ctx.family.predict(ctx.components, noisy.to(ctx.weight_dtype), timesteps, text, batch)
    prior = ctx.scheme.prediction(prior.float(), noisy.float(), timesteps)
    keep = preserve.view(-1, *([1] * (target.dim() - 1)))
    return torch.where(keep, prior.to(target.dtype), target)


def optimizer_step(optimizer: torch.optim.Optimizer, lr_scheduler, max_grad_norm: Optional[float],
                   clip_grad_norm: Callable = torch.nn.utils.clip_grad_norm_,
                   before_step: Optional[Callable[[], None]] = None) -> None:
    """One optimizer step after the gradients are in: clip (when `max_grad_norm`), step, schedule, zero.

    The trainer passes accelerate's clip_grad_norm_ (and no norm while gradients still accumulate);
    the step benchmarks call this same function.
    """
    if max_grad_norm:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        clip_grad_norm(params, max_grad_norm)
    if before_step is not None:  # reads the final (clipped) gradients: LoRA-GGPO's norms
        before_step()
    optimizer.step()
    lr_scheduler.step()
    optimizer.zero_grad(set_to_none=True)
