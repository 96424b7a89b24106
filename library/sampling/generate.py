"""The generation core shared by sampling during training and tools/generate.py.

Prompts become fully seeded `GenerationRequest`s; requests that share a size,
step count, scale and sampler are batched and handed to the family's
`generate`, which owns the model-specific denoising loop. Every image has its
own seed and its own noise generator, so an image does not depend on what else
is in its batch, and a seed gives the same image here and in training samples.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from library.errors import ConfigError
from library.families.base import Components, ModelFamily
from library.sampling.prompts import SamplePrompt
from library.sampling.samplers import canonical_sampler

logger = logging.getLogger(__name__)

SEED_RANGE = 2**31


@dataclass
class GenerationRequest:
    """One image to make. None fields take the family's default (SD: 512x512, 30 steps, CFG 7.5, ddim)."""

    prompt: str
    negative_prompt: str = ""
    seed: int = 0
    width: Optional[int] = None
    height: Optional[int] = None
    steps: Optional[int] = None
    scale: Optional[float] = None
    guidance: Optional[float] = None
    sampler: Optional[str] = None
    index: int = 0  # NN in the file name: the prompt's position (training) or the image's (tool)
    seed_given: bool = False  # the user chose the seed: it goes into the file name, as in sd-scripts

    def batch_key(self) -> tuple:
        """Requests with equal keys can share one denoising batch."""
        return (self.width, self.height, self.steps, self.scale, self.guidance, self.sampler)


@dataclass
class GeneratedImage:
    """An image and the request that made it, with every default filled in."""

    image: Any  # PIL.Image.Image
    request: GenerationRequest


@dataclass
class PromptOverrides:
    """Values from flags that apply where a prompt does not set its own (tools/generate.py)."""

    width: Optional[int] = None
    height: Optional[int] = None
    steps: Optional[int] = None
    scale: Optional[float] = None
    guidance: Optional[float] = None
    sampler: Optional[str] = None
    negative_prompt: Optional[str] = None


def requests_from_prompts(prompts: Sequence[SamplePrompt], images_per_prompt: int = 1,
                          seed: Optional[int] = None, overrides: Optional[PromptOverrides] = None,
                          rng: Optional[random.Random] = None, number_images: bool = False) -> list[GenerationRequest]:
    """Turn prompts into seeded requests.

    Seeds: a prompt's own seed (`--d`) gives its images seed, seed+1, ...; otherwise
    `seed` (the tool's --seed) gives the k-th image of the run seed + k; otherwise a
    random seed is drawn from `rng` (recorded in the PNG metadata either way).
    `number_images` numbers files by image (the tool) instead of by prompt (training).
    """
    o = overrides or PromptOverrides()
    rng = rng or random.Random()
    out: list[GenerationRequest] = []
    for p in prompts:
        sampler = p.sampler or o.sampler
        if sampler is not None:
            sampler = canonical_sampler(sampler)
        for j in range(images_per_prompt):
            k = len(out)
            if p.seed is not None:
                image_seed, given = p.seed + j, True
            elif seed is not None:
                image_seed, given = seed + k, True
            else:
                image_seed, given = rng.randrange(SEED_RANGE), False
            out.append(GenerationRequest(
                prompt=p.prompt,
                negative_prompt=p.negative_prompt or o.negative_prompt or "",
                seed=image_seed % SEED_RANGE if given else image_seed,
                width=p.width or o.width, height=p.height or o.height, steps=p.steps or o.steps,
                scale=p.scale if p.scale is not None else o.scale,
                guidance=p.guidance if p.guidance is not None else o.guidance,
                sampler=sampler, index=k if number_images else p.index, seed_given=given))
    return out


def batches(requests: Sequence[GenerationRequest], batch_size: int) -> list[list[GenerationRequest]]:
    """Consecutive requests with the same batch key, at most batch_size per batch."""
    if batch_size < 1:
        raise ConfigError(f"--batch_size: expected an integer >= 1, got {batch_size}")
    out: list[list[GenerationRequest]] = []
    for r in requests:
        if out and len(out[-1]) < batch_size and out[-1][0].batch_key() == r.batch_key():
            out[-1].append(r)
        else:
            out.append([r])
    return out


@torch.no_grad()
def generate_images(family: ModelFamily, components: Components, requests: Sequence[GenerationRequest], *,
                    clip_skip: Optional[int] = None, device: Optional[torch.device] = None, batch_size: int = 1,
                    progress: bool = False) -> list[GeneratedImage]:
    """Generate every request, in order, batching where the settings allow."""
    from tqdm.auto import tqdm

    device = device or components.denoiser.device
    out: list[GeneratedImage] = []
    groups = batches(requests, batch_size)
    for group in tqdm(groups, desc="images", disable=not progress, unit="batch"):
        out += family.generate(components, group, clip_skip=clip_skip, device=device)
    return out


@dataclass
class NetworkSpec:
    """One LoRA/LyCORIS file to apply at generation: --network_module, --network_weights, --network_mul."""

    module: str
    weights: str
    multiplier: float = 1.0


@dataclass
class AppliedNetworks:
    """Networks hooked into a model (not merged); `remove()` unhooks them."""

    networks: list = field(default_factory=list)

    def remove(self) -> None:
        for network in self.networks:
            network.restore()
        self.networks.clear()


def network_specs(modules: Sequence[str], weights: Sequence[str], multipliers: Sequence[float]) -> list[NetworkSpec]:
    """Pair the per-network flags as sd-scripts' gen_img.py does (one module may serve every file)."""
    if not weights:
        if multipliers:
            raise ConfigError("--network_mul: given without --network_weights")
        return []
    modules = list(modules) or ["networks.lora"]
    if len(modules) == 1:
        modules = modules * len(weights)
    if len(modules) != len(weights):
        raise ConfigError(f"--network_module: expected 1 or {len(weights)} values (one per --network_weights), "
                          f"got {len(modules)}")
    if len(multipliers) > len(weights):
        raise ConfigError(f"--network_mul: expected at most {len(weights)} values (one per --network_weights), "
                          f"got {len(multipliers)}")
    muls = list(multipliers) + [1.0] * (len(weights) - len(multipliers))
    return [NetworkSpec(m, w, float(x)) for m, w, x in zip(modules, weights, muls)]


def apply_networks(family: ModelFamily, components: Components, specs: Sequence[NetworkSpec], merge: bool,
                   device: torch.device, dtype: torch.dtype) -> AppliedNetworks:
    """Load each network file and merge it into the weights (`merge`) or hook it in at its multiplier."""
    import os

    from library.args.network import import_network_module

    applied = AppliedNetworks()
    te = components.text_encoders if len(components.text_encoders) > 1 else components.text_encoders[0]
    for spec in specs:
        if not os.path.isfile(spec.weights):
            raise ConfigError(f"--network_weights {spec.weights}: file not found")
        module = import_network_module(spec.module)
        if module.__name__ == "networks.lora":
            kwargs = {"lora_targets": family.lora_targets(components)}
        else:  # its file carries kohya names (network_setup.kohya_name_map); the module knows raw paths
            from library.train.network_setup import external_state_dict

            kwargs = {"weights_sd": external_state_dict(spec.weights, family, components)}
        network, weights_sd = module.create_network_from_weights(spec.multiplier, spec.weights, components.vae, te,
                                                                 components.denoiser, for_inference=True, **kwargs)
        if merge:
            if hasattr(network, "is_mergeable") and not network.is_mergeable():
                raise ConfigError(f"--merge: {spec.weights} ({spec.module}) cannot be merged; drop --merge")
            network.merge_to(te, components.denoiser, weights_sd, dtype, device)
            logger.info("merged %s at multiplier %s", spec.weights, spec.multiplier)
            continue
        network.apply_to(te, components.denoiser, True, True)
        info = network.load_state_dict(weights_sd, strict=False)
        for lora in getattr(network, "text_encoder_loras", []) + getattr(network, "unet_loras", []):
            if hasattr(lora, "refresh_scale"):  # ours: the scale follows the loaded alpha
                lora.refresh_scale()
        network.to(device, dtype).eval()
        network.set_multiplier(spec.multiplier)
        applied.networks.append(network)
        logger.info("applied %s at multiplier %s (%s)", spec.weights, spec.multiplier, info)
    return applied
