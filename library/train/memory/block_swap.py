"""--blocks_to_swap: transformer blocks kept in CPU memory and streamed to the accelerator.

The swapped blocks' weights live in offload memory (pinned on CUDA) for the whole
run. Right before a swapped block runs it is copied to the compute device, and the
next swapped block in the same direction starts copying on a side stream so the
copy overlaps compute; right after, the device copy is dropped (the weights are
frozen, so the offload copy is still exact and nothing is copied back). Backward
visits the blocks in reverse: a tiny autograd node on the block's outputs brings
it back before its backward, one on its inputs drops it after.

A block of quantized layers (--base_model_precision with optimum-quanto or torchao) moves the same way: the
weight is a tensor subclass whose `.to()` moves its codes and scales together; its offload copy is ordinary
(not page-locked) memory, so its copies to the device are not overlapped as well.

Moving is done by pointing each tensor's `.data` at the other copy, so the tensor
objects (and autograd's saved references to them) stay the same. What saves memory:
- with gradient checkpointing (the recommended pairing): nothing of the block is
  saved between forward and backward; it is recomputed once it is back;
- without it: autograd keeps what it saved for backward. A plain Linear saves a
  transposed view of its weight, which keeps that device copy alive until backward,
  so little is saved; --fp8_base layers save the weight itself, which does move.
LoRA parameters belong to the network, not to the block, and stay on the device.

Trained blocks (a full fine-tune): the parameters stay the same objects, so the optimizer (and its
state, keyed by parameter) always sees the real ones. A gradient travels with its block: it is
accumulated on the compute device and moved to offload memory with the weights, so an optimizer step
after backward updates the offload copy (the step and, for a swapped block, its optimizer state run
in CPU memory). With `write_back` (the optimizer steps inside backward: --fused_backward_pass,
--blockwise_fused_optimizers) the step updates the device copy while the block is resident, and the
block's weights are copied back to offload memory when it leaves after its backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from library.core.errors import UserError


def _in_backward() -> bool:
    """True while autograd runs a backward pass (a checkpointed block is then being recomputed)."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class SwapStats:
    """What the swapper did: for tests and logs."""

    loads: int = 0  # copies to the compute device
    prefetches: int = 0  # of which started ahead of need
    max_resident: int = 0  # most swapped blocks on the compute device at once
    events: list = field(default_factory=list)  # (event, swapped index, resident indices) when `record` is on


class BlockSwapper:
    """Keep the last `num_swap` of `blocks` in offload memory; each visits `compute_device` only to run.

    `blocks` are in forward order. At most 1 + `prefetch` swapped blocks are on the compute
    device at any time (the running one and those copying ahead); the others always are.
    """

    def __init__(self, blocks: list[nn.Module], num_swap: int, compute_device: Any, offload_device: Any = "cpu",
                 prefetch: int = 1, record: bool = False, write_back: bool = False):
        if not 1 <= num_swap <= len(blocks):
            raise ValueError(f"num_swap: expected 1..{len(blocks)}, got {num_swap}")
        self.blocks = list(blocks)
        self.swapped = self.blocks[len(blocks) - num_swap:]
        self.compute_device = torch.device(compute_device)
        self.offload_device = torch.device(offload_device)
        self.prefetch = prefetch
        self.record = record
        self.write_back = write_back  # weights change on the compute device (a step inside backward): copy back
        self._backward_begun: set[int] = set()  # resident blocks whose backward has started since they came in
        self.stats = SwapStats()
        self.cuda = self.compute_device.type == "cuda"
        self._stream = torch.cuda.Stream(self.compute_device) if self.cuda else None
        # Per swapped block: its tensors' offload copies, and the device copies while resident.
        self._offload: list[list[torch.Tensor]] = []
        self._resident: dict[int, Optional[torch.cuda.Event]] = {}
        self._handles: list = []
        self._locked: list[torch.Tensor] = []  # page-locked offload buffers, one per swapped block
        self._install()

    # ------------------------------------------------------------------ setup
    def _tensors(self, block: nn.Module) -> list[torch.Tensor]:
        return list(block.parameters()) + list(block.buffers())

    def _install(self) -> None:
        for block in self.blocks:
            if block not in self.swapped:
                block.to(self.compute_device)
        page_lock = self.cuda and self.offload_device.type == "cpu"  # non_blocking copies need it
        for i, block in enumerate(self.swapped):
            tensors = self._tensors(block)
            if page_lock and all(_plain(t.data) for t in tensors):
                buffer, copies = page_locked_copies([t.data for t in tensors])
                self._locked.append(buffer)
            else:
                copies = [t.data.to(self.offload_device) for t in tensors]
            for t, cpu in zip(tensors, copies):
                t.data = cpu
            self._offload.append(copies)
            self._handles.append(block.register_forward_pre_hook(self._make_pre_hook(i), with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._make_post_hook(i)))

    def remove(self) -> None:
        """Take the hooks off and put every block on the compute device."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for i in range(len(self.swapped)):
            self._load(i, wait=True)
        self._resident.clear()
        for buffer in self._locked:
            if buffer.numel():
                torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
        self._locked.clear()

    # ------------------------------------------------------------------ bookkeeping
    def resident(self) -> list[int]:
        """Indices (into `blocks`) of the blocks now on the compute device."""
        swapped_ids = {id(b) for b in self.swapped}
        first = len(self.blocks) - len(self.swapped)
        return [i for i, b in enumerate(self.blocks) if id(b) not in swapped_ids] + \
            sorted(first + i for i in self._resident)

    def _note(self, event: str, i: int) -> None:
        self.stats.max_resident = max(self.stats.max_resident, len(self._resident))
        if self.record:
            self.stats.events.append((event, len(self.blocks) - len(self.swapped) + i, self.resident()))

    # ------------------------------------------------------------------ moving
    def _load(self, i: int, wait: bool) -> None:
        """Start copying swapped block i to the compute device (no-op when it is there); wait if asked."""
        if i not in self._resident:
            self.stats.loads += 1
            if not wait:
                self.stats.prefetches += 1
            event = None
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    device_copies = [c.to(self.compute_device, non_blocking=True) for c in self._offload[i]]
                    event = torch.cuda.Event()
                    event.record(self._stream)
            else:
                # Synchronous; a copy even when both devices are the CPU, so the moves are real in tests.
                device_copies = [c.to(self.compute_device, copy=True) for c in self._offload[i]]
            for t, d in zip(self._tensors(self.swapped[i]), device_copies):
                t.data = d
            self._resident[i] = event
        if wait:
            event = self._resident[i]
            if event is not None:
                compute = torch.cuda.current_stream(self.compute_device)
                compute.wait_event(event)
                for t in self._tensors(self.swapped[i]):
                    _record_stream(t.data, compute)  # allocated on the side stream, used on this one
                self._resident[i] = None
            for p in self.swapped[i].parameters():  # accumulating gradients (a trained block) join it here
                if p.grad is not None and p.grad.device != p.data.device:
                    p.grad = p.grad.to(p.data.device)

    def _unload(self, i: int) -> None:
        """Drop swapped block i's device copy. The offload copy is still exact unless an optimizer stepped the
        block while it was here (`write_back`, after its backward began): then it is copied back first."""
        if i not in self._resident:
            return
        copy_back = self.write_back and i in self._backward_begun
        for t, c in zip(self._tensors(self.swapped[i]), self._offload[i]):
            if copy_back and t.data is not c:
                c.copy_(t.data)
            t.data = c
        for p in self.swapped[i].parameters():  # gradients leave with the weights (a trained block)
            if p.grad is not None and p.grad.device != p.data.device:
                p.grad = p.grad.to(p.data.device)
        self._backward_begun.discard(i)
        del self._resident[i]

    def release(self) -> None:
        """Send every swapped block back to offload memory (after a backward pass: a block whose inputs
        need no gradient has no node to drop it, so it would stay until the next forward)."""
        self._keep_only(set())

    def _keep_only(self, keep: set[int]) -> None:
        for j in [j for j in self._resident if j not in keep]:
            self._unload(j)

    def _ahead(self, i: int, step: int) -> list[int]:
        return [j for j in range(i + step, i + step * (self.prefetch + 1), step) if 0 <= j < len(self.swapped)]

    # ------------------------------------------------------------------ hooks
    def _make_pre_hook(self, i: int):
        def hook(module, args, kwargs):
            if _in_backward():  # recomputing a checkpointed block: it was brought back before its backward
                self._load(i, wait=True)
            else:
                ahead = self._ahead(i, 1)
                self._keep_only({i, *ahead})
                self._load(i, wait=True)
                for j in ahead:
                    self._load(j, wait=False)
            self._note("forward", i)
            if not torch.is_grad_enabled():
                return None
            return _wrap_tensors((args, kwargs), lambda ts: _OnBackward.apply(lambda: self._after_backward(i), *ts))

        return hook

    def _make_post_hook(self, i: int):
        def hook(module, args, output):
            wrapped = output
            if torch.is_grad_enabled():
                wrapped = _wrap_tensors(output, lambda ts: _OnBackward.apply(lambda: self._before_backward(i), *ts))
            if not _in_backward():
                self._unload(i)
            return wrapped

        return hook

    def _before_backward(self, i: int) -> None:
        ahead = self._ahead(i, -1)
        self._keep_only({i, *ahead})
        self._load(i, wait=True)
        self._backward_begun.add(i)
        for j in ahead:
            self._load(j, wait=False)
        self._note("backward", i)

    def _after_backward(self, i: int) -> None:
        self._unload(i)


_ALIGN = 256  # bytes; every copy starts at a multiple, so any dtype can view it


def _plain(t: torch.Tensor) -> bool:
    """A plain tensor, not a wrapper subclass holding others (a quantized weight of optimum-quanto or torchao)."""
    return type(t) in (torch.Tensor, nn.Parameter)


def _record_stream(t: torch.Tensor, stream) -> None:
    """record_stream on `t`, or on the inner tensors of a wrapper subclass (a quantized weight: codes, scales)."""
    if _plain(t) or not hasattr(t, "__tensor_flatten__"):
        t.record_stream(stream)
        return
    names, _ = t.__tensor_flatten__()
    for name in names:
        _record_stream(getattr(t, name), stream)


def page_locked_copies(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """CPU copies of `tensors` as views into one buffer that is page-locked at its exact size.

    `Tensor.pin_memory()` goes through PyTorch's caching host allocator, which rounds each
    allocation up to a power of two: FLUX.1's swapped blocks would hold about 1.5x their size
    in locked RAM. Registering one plain allocation per block with cudaHostRegister (as
    torch.distributed's checkpoint stager does) locks exactly what is needed.
    """
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // _ALIGN) * _ALIGN
    buffer = torch.empty(total, dtype=torch.uint8)
    copies = []
    for t, offset, size in zip(tensors, offsets, sizes):
        view = buffer[offset:offset + size].view(t.dtype).view(t.shape)
        view.copy_(t)
        copies.append(view)
    if total:
        error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), total, 0))
        if error:
            raise UserError(f"--blocks_to_swap: cannot page-lock {total / 2**20:.0f} MiB of host memory "
                               f"(cudaHostRegister error {error}); free some RAM or swap fewer blocks")
    return buffer, copies


class _OnBackward(torch.autograd.Function):
    """Identity on some tensors whose backward first calls `callback`.

    On a block's outputs its backward runs before the block's (bring the block back); on its
    inputs, after it (drop the block again).
    """

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def _wrap_tensors(tree: Any, apply) -> Any:
    """`tree` (nested tuples / lists / dicts) with its grad-requiring tensors passed through `apply` together."""
    found: list[torch.Tensor] = []

    def collect(x):
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                found.append(x)
        elif isinstance(x, (tuple, list)):
            for y in x:
                collect(y)
        elif isinstance(x, dict):
            for y in x.values():
                collect(y)

    collect(tree)
    if not found:
        return tree
    replaced = dict(zip(map(id, found), apply(found)))

    def rebuild(x):
        if isinstance(x, torch.Tensor):
            return replaced.get(id(x), x)
        if isinstance(x, tuple):
            return tuple(rebuild(y) for y in x)
        if isinstance(x, list):
            return [rebuild(y) for y in x]
        if isinstance(x, dict):
            return {k: rebuild(v) for k, v in x.items()}
        return x

    return rebuild(tree)
