"""Gradients held at once during a FLUX.1 full fine-tune backward: the usual step, --fused_backward_pass and
--blockwise_fused_optimizers, counted on a FLUX.1 transformer with the real block structure (19 double and 38
single blocks) at a width that fits a CPU, and the step time of each mode in the same run.

The count is exact (a post-accumulate-grad hook, registered before the fused optimizer's, sums the elements of
every gradient alive at that moment); the element counts of the full-size model follow from its block sizes
(printed at the end for FLUX.1 dev, counted on the meta device).

    python bench/bench_blockwise_fused.py [--heads 4] [--head_dim 32] [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from library.families.flux.family import optimizer_block, pack_latents  # noqa: E402
from library.families.flux.configs import PRESETS, transformer_config  # noqa: E402
from library.train.optim.fused_backward import FusedBackwardOptimizer  # noqa: E402


def _model(heads: int, head_dim: int):
    from dataclasses import replace

    from diffusers import FluxTransformer2DModel

    preset = replace(PRESETS["random:flux-dev"], heads=heads, head_dim=head_dim, t5_d_model=heads * head_dim * 2,
                     clip_hidden=64, axes_dims_rope=(head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8))
    torch.manual_seed(0)
    return FluxTransformer2DModel(**transformer_config(preset))


def _inputs(model, batch: int = 1, size: int = 16, text: int = 16):
    cfg = model.config
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(batch, 16, size, size, generator=g)
    ids = torch.zeros(size // 2 * size // 2, 3)
    return dict(hidden_states=pack_latents(latents), encoder_hidden_states=torch.randn(batch, text, cfg.joint_attention_dim, generator=g),
                pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g),
                timestep=torch.full((batch,), 0.5), img_ids=ids, txt_ids=torch.zeros(text, 3),
                guidance=torch.full((batch,), 1.0), return_dict=False)


def run(mode: str, heads: int, head_dim: int, steps: int) -> tuple[int, int, float]:
    """(parameters, most gradient elements alive at once, seconds per step) of one mode."""
    model = _model(heads, head_dim).train()
    params = list(model.parameters())
    by_id = {id(p): p for p in params}
    alive: dict[int, int] = {}
    peak = 0

    def count(p):  # runs before the fused optimizer's hook of the same parameter
        nonlocal peak
        for key in [k for k in alive if by_id[k].grad is None]:  # freed by a fused step since
            del alive[key]
        alive[id(p)] = p.numel()
        peak = max(peak, sum(alive.values()))

    handles = [p.register_post_accumulate_grad_hook(count) for p in params]
    groups = [{"params": params, "lr": 1e-4}]
    if mode == "usual":
        opt = torch.optim.AdamW(groups)
    else:
        names = {id(p): optimizer_block(n) for n, p in model.named_parameters()} if mode == "blockwise" else None
        opt = FusedBackwardOptimizer(groups, torch.optim.AdamW, None, None, names)
    inputs = _inputs(model)

    def step():
        model(**inputs)[0].float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # counted
    for h in handles:
        h.remove()
    times = []
    for _ in range(steps):  # timed, without the counting hooks
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return sum(p.numel() for p in params), peak, min(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head_dim", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"FLUX.1 transformer, 19 double + 38 single blocks, hidden {args.heads * args.head_dim}, AdamW, CPU")
    print(f"{'mode':<12} {'parameters':>12} {'peak grads':>12} {'ratio':>7} {'step s':>8}")
    for mode in ("usual", "per_param", "blockwise"):
        n, peak, seconds = run(mode, args.heads, args.head_dim, args.steps)
        print(f"{mode:<12} {n:>12,} {peak:>12,} {peak / n:>7.3f} {seconds:>8.3f}")
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        full = FluxTransformer2DModel(**transformer_config(PRESETS["random:flux-dev"]))
    total = sum(p.numel() for p in full.parameters())
    double = sum(p.numel() for p in full.transformer_blocks[0].parameters())
    rest = total - sum(p.numel() for b in (*full.transformer_blocks, *full.single_transformer_blocks)
                       for p in b.parameters())
    print(f"full size: {total:,} parameters; one double block {double:,}, outside the blocks {rest:,}; "
          f"blockwise holds at most about {(double + rest) / total:.3f} of the gradients")
    return 0


if __name__ == "__main__":
    sys.exit(main())
