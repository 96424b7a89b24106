"""Data parallel with N processes (accelerate launch / torchrun): the pieces the loop uses besides accelerate.

The trained module is not wrapped in DistributedDataParallel: a LoRA network's forward is never called (its
modules hook into the frozen denoiser), so DDP's reducer would never see a forward and would reduce nothing.
Instead `GradientReducer` averages the trained parameters' gradients over the processes after the last
backward of each optimizer step, with torch.distributed all-reduces over flat buckets (one call for a LoRA,
a few for a full fine-tune), and `broadcast_parameters` makes every process start from rank 0's weights.
Everything here is a no-op with one process.

`TRACE_ENV`: when set to a folder, every process appends one JSON line per optimizer step to
`<folder>/rank<rank>.jsonl` (the images of its batches and a hash of its trained parameters), so tests can
check that processes see disjoint batches and hold identical weights.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable, Optional

import torch
import torch.distributed as dist

TRACE_ENV = "SDTRAIN_DISTRIBUTED_TRACE"
BUCKET_BYTES = 64 * 1024 * 1024  # per all-reduce; a LoRA fits in one


def make_accelerator(mixed_precision: str, cpu: bool, ddp_timeout: Optional[int] = None,
                     gradient_as_bucket_view: bool = False, static_graph: bool = False):
    """accelerate's Accelerator with the --ddp_* settings passed to its process group and DDP kwargs."""
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    handlers = []
    if ddp_timeout:
        handlers.append(InitProcessGroupKwargs(timeout=timedelta(minutes=ddp_timeout)))
    if gradient_as_bucket_view or static_graph:
        handlers.append(DistributedDataParallelKwargs(gradient_as_bucket_view=gradient_as_bucket_view,
                                                      static_graph=static_graph))
    return Accelerator(mixed_precision=mixed_precision, cpu=cpu, kwargs_handlers=handlers)


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _buckets(tensors: list[torch.Tensor], limit: int = BUCKET_BYTES) -> list[list[int]]:
    """Indices of `tensors` grouped by (device, dtype) into buckets of at most `limit` bytes (one tensor at least)."""
    out: list[list[int]] = []
    open_bucket: dict[tuple, tuple[list[int], int]] = {}
    for i, t in enumerate(tensors):
        key = (t.device, t.dtype)
        ids, size = open_bucket.get(key, ([], 0))
        nbytes = t.numel() * t.element_size()
        if ids and size + nbytes > limit:
            out.append(ids)
            ids, size = [], 0
        ids.append(i)
        open_bucket[key] = (ids, size + nbytes)
    out.extend(ids for ids, _ in open_bucket.values() if ids)
    return out


class GradientReducer:
    """Averages the gradients of `params` over every process: one all-reduce per flat bucket.

    A parameter without a gradient on a process (unused in its batches, e.g. a text-encoder LoRA under cached
    text outputs) counts as zeros there, so every process reduces the same buckets.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter]):
        self.params = [p for p in params if p.requires_grad]
        self.buckets = _buckets(self.params)

    def reduce(self) -> None:
        n = world_size()
        if n == 1:
            return
        for ids in self.buckets:
            params = [self.params[i] for i in ids]
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat.div_(n)
            offset = 0
            for p in params:
                k = p.numel()
                value = flat[offset:offset + k].view_as(p)
                if p.grad is None:
                    p.grad = value.clone()
                else:
                    p.grad.copy_(value)
                offset += k


def broadcast_parameters(params: Iterable[torch.Tensor]) -> None:
    """Every process takes rank 0's values of `params` (one broadcast per flat bucket)."""
    if world_size() == 1:
        return
    params = list(params)
    with torch.no_grad():
        for ids in _buckets(params):
            flat = torch.cat([params[i].detach().reshape(-1) for i in ids])
            dist.broadcast(flat, src=0)
            offset = 0
            for i in ids:
                k = params[i].numel()
                params[i].copy_(flat[offset:offset + k].view_as(params[i]))
                offset += k


def any_process(flag: bool, device: Optional[torch.device] = None) -> bool:
    """True on every process when `flag` is true on one of them (a stop signal that reached only some)."""
    if world_size() == 1:
        return flag
    backend = dist.get_backend()
    t = torch.tensor([1 if flag else 0], device=device if backend == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def gather_objects(obj) -> list:
    """`obj` of every process, by rank (on every process)."""
    n = world_size()
    if n == 1:
        return [obj]
    out = [None] * n
    dist.all_gather_object(out, obj)
    return out


def parameters_hash(params: Iterable[torch.Tensor]) -> str:
    """sha256 of the parameters' bytes, in order: equal hashes mean bitwise-equal weights."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class StepTrace:
    """The per-step trace for tests (see TRACE_ENV); inactive unless the variable is set."""

    def __init__(self, rank: int):
        folder = os.environ.get(TRACE_ENV)
        self.path = os.path.join(folder, f"rank{rank}.jsonl") if folder else None
        self.images: list[str] = []
        if self.path:
            os.makedirs(folder, exist_ok=True)

    @property
    def active(self) -> bool:
        return self.path is not None

    def batch(self, image_paths: list[str]) -> None:
        if self.path:
            self.images.extend(os.path.basename(p) for p in image_paths)

    def step(self, step: int, epoch: int, params: Iterable[torch.Tensor]) -> None:
        if not self.path:
            return
        line = {"step": step, "epoch": epoch, "images": self.images, "params": parameters_hash(params)}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        self.images = []
