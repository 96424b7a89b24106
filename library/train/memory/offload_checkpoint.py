"""--cpu_offload_checkpointing: gradient checkpointing whose saved block inputs wait in CPU memory.

Plain checkpointing keeps each block's inputs on the accelerator until backward
(for a DiT: the image and text token states of every block). Here they are copied
to the CPU after the block's forward and back right before it is recomputed, so
the accelerator holds the inputs of one block at a time. The recompute replays
the forward with the same RNG and autocast state, so gradients are the ones plain
checkpointing gives. Used as diffusers' `gradient_checkpointing_func`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.utils.checkpoint
from torch import nn


def _flatten(tree: Any, out: list) -> Any:
    """Replace every tensor in nested tuples / lists / dicts by its index in `out`."""
    if isinstance(tree, torch.Tensor):
        out.append(tree)
        return _Slot(len(out) - 1)
    if isinstance(tree, (tuple, list)):
        return type(tree)(_flatten(x, out) for x in tree)
    if isinstance(tree, dict):
        return {k: _flatten(v, out) for k, v in tree.items()}
    return tree


def _unflatten(spec: Any, tensors: list) -> Any:
    if isinstance(spec, _Slot):
        return tensors[spec.index]
    if isinstance(spec, (tuple, list)):
        return type(spec)(_unflatten(x, tensors) for x in spec)
    if isinstance(spec, dict):
        return {k: _unflatten(v, tensors) for k, v in spec.items()}
    return spec


class _Slot:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of `t`. From CUDA: into page-locked memory without waiting (the copy back in
    backward is queued on the same stream, after this one), so the forward never stalls on it."""
    t = t.detach()
    if t.device.type != "cuda":
        return t.to("cpu")
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class _OffloadedCheckpoint(torch.autograd.Function):
    """Run `fn` without keeping its graph; keep its tensor inputs on the CPU; recompute in backward."""

    @staticmethod
    def forward(ctx, fn: Callable, spec: Any, device: torch.device, *tensors: torch.Tensor):
        ctx.fn, ctx.spec, ctx.device = fn, spec, device
        ctx.needs_grad = [t.requires_grad for t in tensors]
        ctx.devices = [t.device for t in tensors]
        ctx.autocast = _autocast_state(device.type)
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        ctx.saved = [_to_host(t) for t in tensors]
        with torch.no_grad():
            outputs = fn(*_unflatten(spec, list(tensors)))
        ctx.single = isinstance(outputs, torch.Tensor)
        return outputs if ctx.single else tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = []
        for t, dev, needs in zip(ctx.saved, ctx.devices, ctx.needs_grad):
            t = t.to(dev, non_blocking=dev.type == "cuda").detach()
            inputs.append(t.requires_grad_(needs))
        ctx.saved = None
        devices = [ctx.device] if ctx.cuda_rng is not None else []
        enabled, dtype = ctx.autocast
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, ctx.device)
            with torch.enable_grad(), torch.autocast(ctx.device.type, dtype=dtype, enabled=enabled):
                outputs = ctx.fn(*_unflatten(ctx.spec, inputs))
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None, *[t.grad if needs else None for t, needs in zip(inputs, ctx.needs_grad)])


def offloaded_checkpoint(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """diffusers' gradient_checkpointing_func: module(*args, **kwargs), the positional inputs kept on the CPU until
    backward (keyword ones, masks and position embeddings in HunyuanImage's model, stay where they are)."""
    tensors: list[torch.Tensor] = []
    spec = _flatten(args, tensors)
    call = functools.partial(module.__call__, **kwargs) if kwargs else module.__call__
    if not tensors:
        return call(*args)
    device = next((t.device for t in tensors if t.device.type != "cpu"), tensors[0].device)
    # An input that needs a gradient, so the block's LoRA parameters get theirs even when no real input
    # does (e.g. the first block, fed by embedders without LoRA).
    anchor = torch.empty(0, device=device, requires_grad=True)
    return _OffloadedCheckpoint.apply(call, spec, device, *tensors, anchor)


def checkpoint(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """diffusers' own gradient_checkpointing_func (non-reentrant torch checkpoint), taking keyword inputs too:
    HunyuanImageTransformer2DModel passes its blocks some, which diffusers 0.42's own function refuses."""
    return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False, **kwargs)


def enable_gradient_checkpointing(model: nn.Module, cpu_offload: bool, policy: str = "full") -> None:
    """Checkpoint `model`'s blocks (diffusers' own function, the CPU-offloading one, or a selective policy of
    library/train/memory/checkpoint_policy.py) and set train mode, without which diffusers models skip
    checkpointing (the frozen base has no dropout)."""
    if cpu_offload and policy != "full":
        raise ValueError(f"--cpu_offload_checkpointing with --gradient_checkpointing_policy {policy}: the offloaded "
                         "checkpoint keeps only block inputs; use --gradient_checkpointing_policy full")
    if cpu_offload:
        func = offloaded_checkpoint
    elif policy == "full":
        func = checkpoint
    else:
        from library.train.memory.checkpoint_policy import selective_checkpoint
        func = selective_checkpoint(policy)
    model.enable_gradient_checkpointing(gradient_checkpointing_func=func)
    model.train()
