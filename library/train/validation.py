"""Validation loss: the same loss as training, at fixed timesteps with fixed noise, without gradients."""

from __future__ import annotations

import torch

from library.train.step import StepContext, batch_loss

# sd-scripts evaluates every validation batch at these DDPM timesteps; a flow scheme may define its own.
DEFAULT_VALIDATION_TIMESTEPS = (200, 400, 600, 800)


@torch.no_grad()
def validation_loss(ctx: StepContext, data, refs, seed: int) -> float:
    """Mean loss over the validation batches and the fixed timesteps; training RNG is not touched."""
    generator = torch.Generator("cpu").manual_seed(seed)
    timesteps = getattr(ctx.scheme, "validation_timesteps", DEFAULT_VALIDATION_TIMESTEPS)
    total, count = 0.0, 0
    for ref in refs:
        batch = data.load_batch(ref)
        if not batch["image_paths"]:
            continue
        bsz = len(batch["captions"])
        for t in timesteps:
            ts = torch.full((bsz,), t, dtype=torch.long)
            loss, _ = batch_loss(ctx, batch, generator, timesteps=ts)
            total += loss.item()
            count += 1
    return total / count if count else float("nan")
