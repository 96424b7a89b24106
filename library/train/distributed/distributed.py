"""Data parallel with N processes (accelerate launch / torchrun): the pieces the loop uses besides accelerate.

The trained weights are wrapped in PyTorch's DistributedDataParallel through `StepModule`, a module that holds
them and whose forward is one batch's loss. A LoRA network's own forward is never called (its modules hook into
the frozen denoiser), so wrapping the network alone would leave DDP's reducer idle; with the loss as the forward,
DDP sees every step, averages the gradients in buckets while backward still runs (overlapping communication
with computation), broadcasts rank 0's weights at the start, and its options apply (`--ddp_static_graph`,
`--ddp_gradient_as_bucket_view`; unused parameters are searched only when some can be unused: a text encoder
that trains, or LoRA module dropout). Everything here is a no-op with one process.

`TRACE_ENV`: when set to a folder, every process appends one JSON line per optimizer step to
`<folder>/rank<rank>.jsonl` (the images of its batches and a hash of its trained parameters), so tests can
check that processes see disjoint batches and hold identical weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

TRACE_ENV = "SDTRAIN_DISTRIBUTED_TRACE"


DDP_BACKENDS = ("auto", "nccl", "gloo")


def ddp_backend_problem(backend: str, cpu: bool, cuda: bool, platform: str = sys.platform) -> Optional[str]:
    """Why --ddp_backend `backend` cannot run here (None when it can). nccl needs CUDA GPUs and is not built
    for Windows; gloo runs everywhere (CPU tensors; on GPUs the collectives go through host memory)."""
    if backend != "nccl":
        return None
    if platform.startswith("win"):
        return "--ddp_backend nccl: NCCL is not available on Windows; use gloo (or auto)"
    if cpu or not cuda:
        return "--ddp_backend nccl: needs CUDA GPUs" + (" (--cpu is given)" if cpu else " (none found)") + \
            "; use gloo (or auto)"
    return None


def resolved_ddp_backend(backend: str, cpu: bool, cuda: bool, platform: str = sys.platform) -> Optional[str]:
    """The backend to ask torch.distributed for: None lets accelerate choose (auto: nccl on CUDA, gloo on CPU),
    except on Windows, where auto means gloo (PyTorch has no NCCL there)."""
    if backend == "auto":
        return "gloo" if platform.startswith("win") and cuda and not cpu else None
    return backend


def make_accelerator(mixed_precision: str, cpu: bool, ddp_timeout: Optional[int] = None, ddp_backend: str = "auto"):
    """accelerate's Accelerator, with --ddp_timeout (minutes) as its process group's timeout and --ddp_backend's
    choice of backend. The DDP options apply where the loop wraps its StepModule (`data_parallel`)."""
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    backend = resolved_ddp_backend(ddp_backend, cpu, torch.cuda.is_available())
    group: dict = {}
    if ddp_timeout:
        group["timeout"] = timedelta(minutes=ddp_timeout)
    if backend is not None:
        group["backend"] = backend
    handlers = [InitProcessGroupKwargs(**group)] if group else []
    return Accelerator(mixed_precision=mixed_precision, cpu=cpu, kwargs_handlers=handlers)


def load_in_turns(load: Callable[[], object], accelerator, enabled: bool):
    """`load()` on every process; with `enabled` (--lowram) the processes of one machine take turns (local rank
    0 first, a barrier after each turn), as sd-scripts loads its models. Reading a checkpoint briefly holds its
    tensors and the model built from them; in turns a machine's RAM holds that peak once, not once per process.
    Every machine must run the same number of processes (LOCAL_WORLD_SIZE, set by torchrun / accelerate launch)."""
    n = accelerator.num_processes
    if not enabled or n == 1:
        return load()
    turns = int(os.environ.get("LOCAL_WORLD_SIZE", n))
    loaded = None
    for turn in range(turns):
        if turn == accelerator.local_process_index:
            loaded = load()
        accelerator.wait_for_everyone()
    return loaded


def _asked_processes(argv: list[str]) -> Optional[int]:
    """The value of `--num_processes` / `--num-processes` in a launcher's command line, else None."""
    for i, arg in enumerate(argv):
        for name in ("--num_processes", "--num-processes"):
            value = argv[i + 1] if arg == name and i + 1 < len(argv) else \
                arg[len(name) + 1:] if arg.startswith(name + "=") else None
            if value is not None:
                return int(value) if value.isdigit() else None
    return None


def _parent_argv() -> list[str]:
    """The launching process's command line (Linux /proc; [] elsewhere or when unreadable)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def lone_process_note(num_processes: int, environ=os.environ, launcher_argv: Optional[list[str]] = None,
                      script: Optional[str] = None) -> Optional[str]:
    """One line when `accelerate launch` was asked for several processes but this run has one, else None.

    accelerate's simple launcher (what `--cpu` runs, or a launch without a multi-GPU setting) starts one process
    whatever `--num_processes` says, unless MPI starts them. It exports ACCELERATE_USE_CPU (every `accelerate
    launch` does), MASTER_ADDR / MASTER_PORT only when asked for more than one process (or machine), and no
    WORLD_SIZE (torchrun and accelerate's multi-GPU launcher set that). N itself is not exported: it is read from
    the launcher's command line where it can be (`launcher_argv`, default the parent process's), else written N.
    """
    if num_processes != 1 or "ACCELERATE_USE_CPU" not in environ or "MASTER_ADDR" not in environ \
            or "WORLD_SIZE" in environ:
        return None
    asked = _asked_processes(_parent_argv() if launcher_argv is None else launcher_argv)
    n = str(asked) if asked and asked > 1 else "N"
    script = script or os.path.basename(sys.argv[0]) or "<script>"
    return (f"accelerate launch was asked for {'several' if n == 'N' else n} processes but started only this one "
            f"(its launcher starts several CPU processes only through MPI, GPU ones only with --multi_gpu): this "
            f"run trains as 1 process; for {n}: `torchrun --nproc_per_node {n} {script} --cpu ...` (CPU) or "
            f"`accelerate launch --multi_gpu --num_processes {n} {script} ...` (GPUs), see docs/distributed.md")


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class StepModule(torch.nn.Module):
    """The trained weights (`trained`, a registered child) with one batch's loss as the forward.

    `loss_fn(batch, generator) -> (loss, per_sample_loss)` is a plain callable (the frozen model it runs is not a
    child, so DDP neither broadcasts nor reduces it). `forward(None, _)` is a process's turn without images (every
    image of its batch failed to decode): a zero loss over every trained parameter, so the process still joins
    the gradient all-reduce of the others with zeros.
    """

    def __init__(self, trained: torch.nn.Module, loss_fn: Callable):
        super().__init__()
        self.trained = trained
        self.loss_fn = loss_fn

    def forward(self, batch: Optional[dict], generator: torch.Generator):
        if batch is None:
            zero = sum(p.sum() for p in self.trained.parameters() if p.requires_grad) * 0.0
            return zero, None
        return self.loss_fn(batch, generator)


def unused_parameters_possible(trains_text_encoder: bool, module_dropout: Optional[str]) -> bool:
    """Whether some trained parameters can miss a step's backward, so DDP must look for them: a trained text
    encoder (with --clip_skip 2 its last layer's LoRA gets no gradient; its outputs may come from a cache) or
    LoRA module dropout (a dropped module's weights get none that step)."""
    return trains_text_encoder or bool(module_dropout and float(module_dropout) > 0)


def data_parallel(module: StepModule, device: torch.device, find_unused_parameters: bool,
                  gradient_as_bucket_view: bool = False, static_graph: bool = False) -> torch.nn.Module:
    """`module` wrapped in DistributedDataParallel (as accelerate wraps a prepared model, without its autocast
    forward: the loss computes its own precision), or `module` itself with one process."""
    if world_size() == 1:
        return module
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids, output_device=ids[0] if ids else None,
                                   find_unused_parameters=find_unused_parameters and not static_graph,
                                   gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph)


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
        p = p.to_local() if hasattr(p, "to_local") else p  # FSDP: this process's shard
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class StepTrace:
    """The per-step trace for tests (see TRACE_ENV); inactive unless the variable is set."""

    def __init__(self, rank: int):
        folder = os.environ.get(TRACE_ENV)
        self.path = os.path.join(folder, f"rank{rank}.jsonl") if folder else None
        self.images: list[str] = []
        self.meta: dict = {}  # written on every line (e.g. the DDP settings in force)
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
        line = {"step": step, "epoch": epoch, "images": self.images, "params": parameters_hash(params),
                "time": time.time(), **self.meta}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        self.images = []
