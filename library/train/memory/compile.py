"""--torch_compile: regional compilation of the denoiser's repeated blocks with torch.compile.

Each block (the family's `block_classes`: `BasicTransformerBlock` / `ResnetBlock2D` for SD and SDXL, the two FLUX.1
block kinds) is compiled on its own with `nn.Module.compile`, in place. Blocks of one class share their code,
so dynamo traces each distinct block shape once instead of the whole denoiser as one graph: the first step is
much shorter than with a whole-model compile and a graph break stays local. It composes with gradient
checkpointing (the checkpoint wraps the compiled block) and LoRA (the LoRA modules' forwards are traced inside
the blocks; the adapter is applied before the first step). A family without block classes compiles its whole
denoiser.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

logger = logging.getLogger(__name__)

DYNAMO_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class CompileOptions:
    torch_compile: bool = False
    dynamo_backend: str = "inductor"
    dynamo_mode: Optional[str] = None  # inductor only
    dynamo_fullgraph: bool = False
    dynamo_dynamic: bool = False


def dynamo_backends() -> list[str]:
    """The torch.compile backends this PyTorch has (what --dynamo_backend accepts), lower case."""
    import torch._dynamo

    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def compile_blocks(model: torch.nn.Module, block_classes: tuple[str, ...], opts: CompileOptions) -> int:
    """Compile every block of `model` whose class is in `block_classes` (in place); returns how many. With no
    such block the whole model is compiled (returns 1)."""
    kwargs = {"backend": opts.dynamo_backend, "fullgraph": opts.dynamo_fullgraph, "dynamic": opts.dynamo_dynamic}
    if opts.dynamo_mode and opts.dynamo_backend == "inductor":
        kwargs["mode"] = opts.dynamo_mode
    names = set(block_classes)
    # by the class or a base class: FSDP2 turns a sharded Block into a subclass named FSDPBlock
    blocks = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    # One compiled graph serves every block of a kind and shape (parameters are graph inputs); a UNet has a
    # dozen shapes per block kind, more than dynamo's default limit of 8 graphs per function.
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    for block in blocks:
        block.compile(**kwargs)
    if not blocks:
        model.compile(**kwargs)
        logger.info("--torch_compile: the whole %s compiled (%s)", type(model).__name__, opts.dynamo_backend)
        return 1
    logger.info("--torch_compile: %d blocks of %s compiled (%s; the first step traces them)", len(blocks),
                type(model).__name__, opts.dynamo_backend)
    return len(blocks)
