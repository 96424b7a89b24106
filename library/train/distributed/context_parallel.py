"""Context parallelism (--context_parallel_size N): the tokens of each sample split over N processes.

The denoiser's own context-parallel plan does the work: diffusers' `enable_parallelism` with a
`ContextParallelConfig(ulysses_degree=N)` splits the image and text tokens at the model's input, exchanges them
with all-to-all around every attention (Ulysses: each process attends over the whole sequence for 1/N of the
heads) and gathers the output at `proj_out`. Nothing of that is ours. What the trainer adds:

- the processes of one context-parallel group train the *same* batch: the data is shared out over the
  world_size / N data-parallel groups (`data_rank`), so every process of a group draws the same samples, noise
  and timesteps (all per-sample draws are functions of the sample's place, library/data/batching.py);
- each process's gradients cover its share of the tokens; DDP averages over all processes, so the loss is
  multiplied by N before backward (`loss_scale`): the averaged gradient is then the data-parallel mean of whole
  samples' gradients, as without context parallelism (tested: tests/test_context_parallel.py);
- the checks before loading: a family whose denoiser has a plan, a world size N divides, every bucket's token
  count divisible by N, and no combination that would interfere (FSDP, DeepSpeed, block swap, compile).

diffusers resolves the device mesh for an accelerator; on CPUs (gloo) the mesh is resolved here on the CPU
device, the same ParallelConfig.setup call diffusers makes.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch


def data_rank(rank: int, world_size: int, cp_size: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel world size): processes rank // N share one batch."""
    return rank // cp_size, world_size // cp_size


def loss_scale(cp_size: int) -> int:
    """The factor on the loss before backward (see the module docstring)."""
    return cp_size


def context_parallel_problem(cp_size: int, world_size: int, token_pixels: Optional[int], family: str,
                             buckets: Iterable[tuple[int, int]] = (), *, fsdp: bool = False, deepspeed: bool = False,
                             blocks_to_swap: int = 0, compile: bool = False,
                             family_refusal: Optional[str] = None) -> Optional[str]:
    """Why --context_parallel_size `cp_size` cannot run (None: it can); `buckets`: (width, height) of the data's."""
    if cp_size == 1:
        return None
    flag = f"--context_parallel_size {cp_size}"
    if token_pixels is None:
        return (f"{flag}: {family}'s denoiser has no context-parallel plan in diffusers (FLUX.1, FLUX.2 and "
                "Qwen-Image have; see docs/distributed.md)")
    if world_size % cp_size:
        return f"{flag}: the {world_size} process(es) must be a multiple of it"
    for why, on in (("FSDP", fsdp), ("DeepSpeed", deepspeed), ("--blocks_to_swap", blocks_to_swap > 0),
                    ("--torch_compile", compile)):
        if on:
            return f"{flag}: not with {why} (the split runs around the denoiser's own attention; use DDP)"
    if family_refusal:  # the family's own options (ModelFamily.context_parallel_refusal)
        return f"{flag}: not with {family_refusal}"
    for width, height in sorted(set(buckets)):
        tokens = (width // token_pixels) * (height // token_pixels)
        if tokens % cp_size:
            return (f"{flag}: the {width}x{height} bucket has {tokens} image tokens, not divisible by {cp_size}; "
                    f"choose resolutions / bucket steps whose token grid (1 token per {token_pixels} px) divides")
    return None


def check_context_parallel(cp_size: int, family, world_size: int, buckets: Iterable[tuple[int, int]] = (),
                           **run) -> None:
    """context_parallel_problem as a UserError: called before the data is read (the run's settings) and again
    with the buckets once they are known."""
    from library.core.errors import UserError

    problem = context_parallel_problem(cp_size, world_size, family.context_parallel_token_pixels, family.name,
                                       buckets, **run)
    if problem:
        raise UserError(problem)


def apply_context_parallel(model: torch.nn.Module, cp_size: int, device: torch.device) -> None:
    """Split the denoiser's tokens over groups of `cp_size` processes (Ulysses) through its diffusers plan."""
    from diffusers import ContextParallelConfig, ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    mesh = init_device_mesh(device.type, (world // cp_size, 1, cp_size), mesh_dim_names=("dp", "ring", "ulysses"))
    config = ContextParallelConfig(ulysses_degree=cp_size, mesh=mesh)
    if device.type == "cpu":  # diffusers picks the accelerator's device; gloo runs on the CPU
        def resolve(cfg):
            cfg = ParallelConfig(context_parallel_config=cfg) if isinstance(cfg, ContextParallelConfig) else cfg
            cfg.setup(torch.distributed.get_rank(), world, device, mesh=cfg.context_parallel_config.mesh)
            model._parallel_config = cfg
            return cfg

        model._resolve_parallel_config = resolve
    model.enable_parallelism(config=config)

