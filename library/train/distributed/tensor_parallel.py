"""Tensor parallelism (--tensor_parallel_size N): the frozen denoiser's Linear layers sharded over N processes.

The denoiser's own tensor-parallel plan says how: diffusers' `_tp_plan` (FLUX.1: the attention's Q / K / V and
the MLPs' first Linear column-wise, their output Linear row-wise; the single blocks' fused output Linear in packed
row blocks). PyTorch's `parallelize_module` shards each planned Linear into DTensors and hooks its input and
output (a column-wise Linear hands on its share of the heads, a row-wise one sums the shares back): nothing of the
communication is ours. diffusers' attention processors work on the local heads (`unflatten(-1, (-1, head_dim))`).

A LoRA module on a sharded Linear follows it, as DTensors on the same mesh, so the math is that of one process:

- column-wise base (output rows split): `lora_up` is split by rows like the base (packed blocks alike);
  `lora_down` is replicated (its gradient, a partial sum on each process, is summed by DTensor's backward);
- row-wise base (input columns split): `lora_down` is split by columns like the base; `lora_up` is replicated;
  the LoRA's output is a partial sum added to the base's partial sum before the row-wise Linear's own reduction.

The other trained tensors (LoRA modules on unplanned Linears) see the same replicated inputs on every process of a
group and so get the same gradients: they start from rank 0's values and need no reduction within it. The N
processes of a group train the same batch (`context_parallel.data_rank` with N).

Data parallelism over the groups (world size = dp x N): a 2-D DeviceMesh ("dp", "tp") from PyTorch's
`init_device_mesh` (consecutive ranks form a tensor-parallel group, as `data_rank` shares the data out), the base
sharded over the "tp" sub-mesh. Each group trains its own share of the batches; every trained tensor's gradient (a
DTensor's local shard, or a plain tensor) is averaged over the "dp" process group by `dist.all_reduce` once per
optimizer step, after accumulation and before clipping (`reduce_gradients`, called by the loop), so all groups step
the same weights on the gradient of the global batch.
No DDP: its wrapper would swap the DTensor weights for local tensors around every forward. accelerate's
`ParallelismConfig` does not build this mesh: it refuses dp_replicate > 1 with tp > 1 unless dp_shard > 1 (it
composes tensor parallelism with FSDP / HSDP only).

A save gathers the shards into whole tensors (`gathered`): the same file, with the same keys, as one process
writes; a state folder holds the whole weights and optimizer state (`full_state`) and a resume shards them again
(`load_full_state`). The checks before loading are `tensor_parallel_problem`'s.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)


def tensor_parallel_problem(tp_size: int, world_size: int, has_plan: bool, family: str, *, fsdp: bool = False,
                            deepspeed: bool = False, blocks_to_swap: int = 0, compile: bool = False,
                            fp8: bool = False, fine_tune: bool = False, ema: bool = False,
                            cp_size: int = 1, dropout: bool = False) -> Optional[str]:
    """Why --tensor_parallel_size `tp_size` cannot run (None: it can)."""
    if tp_size == 1:
        return None
    flag = f"--tensor_parallel_size {tp_size}"
    if not has_plan:
        return (f"{flag}: {family}'s denoiser has no tensor-parallel plan (FLUX.1, FLUX.2 and Qwen-Image have; see "
                "docs/distributed.md)")
    for why, on in (("FSDP", fsdp), ("DeepSpeed", deepspeed), ("--blocks_to_swap", blocks_to_swap > 0),
                    ("--torch_compile", compile), ("--fp8_base (a float8 / quantized base cannot be sharded)", fp8),
                    ("a full fine-tune, ControlNet or textual inversion (only a LoRA follows the sharded base)",
                     fine_tune),
                    ("--context_parallel_size", cp_size > 1), ("--use_ema", ema),
                    ("LoRA dropout (--network_dropout, rank_dropout, module_dropout: each process draws its own)",
                     dropout)):
        if on:
            return f"{flag}: not with {why}"
    if world_size % tp_size:
        return (f"{flag}: the {world_size} process(es) must be a multiple of it (data parallelism runs over "
                f"groups of {tp_size})")
    return None


def lora_dropout(network) -> bool:
    """Whether the run's NetworkOptions (None: not a network) ask for any LoRA dropout."""
    if network is None:
        return False
    args = network.network_args
    return bool(network.network_dropout) or any(float(args.get(k) or 0) > 0 for k in ("rank_dropout",
                                                                                       "module_dropout"))


def check_tensor_parallel(tp_size: int, family, world_size: int, **run) -> None:
    """tensor_parallel_problem as a UserError, before anything loads."""
    from library.core.errors import UserError

    problem = tensor_parallel_problem(tp_size, world_size, family.tensor_parallel, family.name, **run)
    if problem:
        raise UserError(problem)


def _expanded_plan(model: torch.nn.Module, plan: dict) -> dict[str, Any]:
    """{qualified Linear name: style} from a plan whose keys may hold one `*` over a ModuleList."""
    out = {}
    for pattern, style in plan.items():
        prefix, star, suffix = pattern.partition("*")
        if not star:
            out[pattern] = style
            continue
        for i in range(len(model.get_submodule(prefix.strip(".")))):
            out[f"{prefix}{i}{suffix}"] = style
    return out


def _packed_blocks(style: Any, module: torch.nn.Module, dim: int) -> Optional[list[int]]:
    """The absolute block sizes of a packed style along `dim` (None: a plain style)."""
    from diffusers.hooks.tensor_parallel import (
        PackedColwiseParallel,
        PackedRowwiseParallel,
        _blocks_to_block_sizes,
    )

    if not isinstance(style, (PackedColwiseParallel, PackedRowwiseParallel)):
        return None
    attr = "_tp_packed_col_blocks" if isinstance(style, PackedColwiseParallel) else "_tp_packed_row_blocks"
    blocks = style.blocks if style.blocks is not None else getattr(module, attr)
    return _blocks_to_block_sizes(module.weight.shape[dim], blocks)


class TensorParallel:
    """The mesh and plan of a sharded denoiser; how the LoRA follows it and how its shards come back whole.

    Set as the trainable's `sharding` (library/train/adapters/trainables.py): saves enter `gathered`, the
    optimizer step averages the gradients over "dp" (`reduce_gradients`) and clips with `clip_grad_norm_`, every
    process samples (all take part in each forward)."""

    def __init__(self, mesh, styles: dict[int, tuple[str, Any, torch.nn.Module]], dp_group=None, dp_size: int = 1):
        self.mesh = mesh  # the "tp" (sub-)mesh
        self.dp_group, self.dp_size = dp_group, dp_size  # the "dp" process group of this process (None: dp 1)
        self.styles = styles  # id(Linear) -> (name, style, Linear)
        self.packed: dict[int, tuple[int, list[int]]] = {}  # id(parameter) -> (dim, block sizes)
        self.dp_trained: list[torch.Tensor] = []  # the tensors whose gradients are averaged over "dp" (dp > 1)

    # --- the LoRA follows the base -----------------------------------------------------------------------
    def shard_adapter(self, network: torch.nn.Module) -> int:
        """Make `network`'s trained tensors DTensors on the mesh (see the module docstring); returns how many
        LoRA modules follow a sharded Linear. Unplanned ones take rank 0's values."""
        from library.core.errors import UserError
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

        if self.dp_size > 1:  # every group starts from global rank 0's values
            import torch.distributed as dist

            with torch.no_grad():
                for p in network.parameters():
                    dist.broadcast(p.data, src=0)
        followed, done = 0, set()
        for module in network.modules():
            org = getattr(module, "org_module", None)
            entry = self.styles.get(id(org)) if org is not None else None
            if entry is None:
                continue
            name, style, linear = entry
            down, up = getattr(module, "lora_down", None), getattr(module, "lora_up", None)
            if not (isinstance(down, torch.nn.Linear) and isinstance(up, torch.nn.Linear)) or down.bias is not None:
                raise UserError(f"--tensor_parallel_size: {type(module).__name__} on {name} is not a LoRA "
                                "(lora_down / lora_up Linear layers without bias); only a LoRA follows the shards")
            colwise = style == "colwise" or "Colwise" in type(style).__name__
            split, whole = (up, down) if colwise else (down, up)
            dim = 0 if colwise else 1
            blocks = _packed_blocks(style, linear, dim)
            weight = split.weight
            with torch.no_grad():
                if blocks is None:
                    sharded = distribute_tensor(weight.detach(), self.mesh, [Shard(dim)])
                else:
                    from diffusers.hooks.tensor_parallel import _local_shard

                    full = distribute_tensor(weight.detach(), self.mesh, [Replicate()]).to_local()
                    sharded = DTensor.from_local(_local_shard(full, dim, blocks, self.mesh), self.mesh, [Shard(dim)],
                                                 run_check=False)
                split.weight = torch.nn.Parameter(sharded, requires_grad=weight.requires_grad)
                if blocks is not None:
                    self.packed[id(split.weight)] = (dim, blocks)
                w = whole.weight
                whole.weight = torch.nn.Parameter(distribute_tensor(w.detach(), self.mesh, [Replicate()]),
                                                  requires_grad=w.requires_grad)
            done.update((id(split.weight), id(whole.weight)))
            followed += 1
        with torch.no_grad():  # the rest: rank 0's initial values on every process
            for p in network.parameters():
                if id(p) not in done and not isinstance(p, DTensor):
                    p.copy_(distribute_tensor(p.detach(), self.mesh, [Replicate()]).to_local())
        logger.info("tensor parallelism: %d of the LoRA's modules follow the %d sharded Linear layers", followed,
                    len(self.styles))
        if self.dp_size > 1:
            self.dp_trained = [p for p in network.parameters() if p.requires_grad]
            logger.info("data parallelism over %d tensor-parallel groups: %d trained tensors averaged over \"dp\"",
                        self.dp_size, len(self.dp_trained))
        return followed

    def reduce_gradients(self) -> None:
        """Before the optimizer step (the micro-steps' gradients accumulated): each trained tensor's gradient (this
        process's shard) averaged over the "dp" group. Nothing with one group."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            for param in self.dp_trained:
                grad = param.grad
                if grad is None:
                    continue
                local = grad.to_local() if isinstance(grad, DTensor) else grad  # a view: reduced in place
                dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.dp_group)
                local.div_(self.dp_size)

    # --- whole tensors ------------------------------------------------------------------------------------
    def full(self, param: torch.Tensor) -> torch.Tensor:
        """`param` whole (every process takes part); packed blocks back in their order."""
        return self._whole_like(param, param.detach())

    def gathered(self, module: torch.nn.Module, keep: bool):
        """Inside, `module`'s DTensor parameters are whole plain tensors where `keep` (every process enters)."""
        from library.train.distributed.sharding_fsdp2 import dtensors_whole

        return dtensors_whole(module, keep, self.full)

    def _shard_like(self, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """`full` (a whole tensor of `param`'s shape) laid out as `param` is: this process's shard as a DTensor."""
        from diffusers.hooks.tensor_parallel import _local_shard
        from torch.distributed.tensor import DTensor, Shard

        placement = param.placements[0]
        packed = self.packed.get(id(param))
        full = full.to(param.device, param.dtype)
        if isinstance(placement, Shard):
            blocks = packed[1] if packed is not None else [full.shape[placement.dim]]
            local = _local_shard(full, placement.dim, blocks, self.mesh)
        else:
            local = full
        return DTensor.from_local(local, self.mesh, [placement], run_check=False)

    def _optimizer_params(self, optimizer) -> list[torch.Tensor]:
        """The parameters in the order of the optimizer's state_dict indices."""
        return [p for group in getattr(optimizer, "optimizer", optimizer).param_groups for p in group["params"]]

    def full_state(self, module: torch.nn.Module, optimizer) -> tuple[dict[str, torch.Tensor], dict]:
        """(whole weights, whole optimizer state) as one process's state folder holds them (every process calls)."""

        params = self._optimizer_params(optimizer)
        weights = {k: self.full(v) for k, v in module.state_dict(keep_vars=True).items()}
        state = getattr(optimizer, "optimizer", optimizer).state_dict()
        state["state"] = {i: {k: self._whole_like(params[i], v) for k, v in s.items()}
                          for i, s in state["state"].items()}
        return {k: v.detach() for k, v in weights.items()}, state

    def _whole_like(self, param: torch.Tensor, value: Any) -> Any:
        """An optimizer state tensor of `param` whole (packed blocks in order, as `full`)."""
        from torch.distributed.tensor import DTensor

        if not isinstance(value, DTensor):
            return value
        full = value.full_tensor()
        packed = self.packed.get(id(param))
        if packed is None:
            return full
        dim, blocks = packed
        n = self.mesh.size()
        ranks = [r.split([b // n for b in blocks], dim=dim) for r in full.chunk(n, dim=dim)]
        return torch.cat([torch.cat([ranks[r][b] for r in range(n)], dim=dim) for b in range(len(blocks))], dim=dim)

    def load_full_state(self, module: torch.nn.Module, optimizer, weights: dict[str, torch.Tensor],
                        optimizer_state: dict) -> None:
        """A state folder's whole weights and optimizer state back into the shards (every process)."""
        from torch.distributed.tensor import DTensor

        own = module.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, value in own.items():
                if isinstance(value, DTensor):
                    value.to_local().copy_(self._shard_like(value, weights[name]).to_local())
                else:
                    value.copy_(weights[name])
        params = self._optimizer_params(optimizer)
        state = dict(optimizer_state)
        state["state"] = {int(i): {k: self._shard_like(params[int(i)], v)
                                   if isinstance(params[int(i)], DTensor) and torch.is_tensor(v)
                                   and v.shape == params[int(i)].shape else v for k, v in s.items()}
                          for i, s in optimizer_state["state"].items()}
        getattr(optimizer, "optimizer", optimizer).load_state_dict(state)

    def local_state(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The trained tensors as this process holds them (a DTensor's own shard)."""
        from torch.distributed.tensor import DTensor

        return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}

    def full_shapes(self, module: torch.nn.Module) -> dict[str, torch.Size]:
        return {k: v.shape for k, v in module.state_dict().items()}

    @staticmethod
    def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole gradient; a DTensor gradient's norm is that of the whole tensor
        (DTensor reduces it)."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in params if p.grad is not None]
        norms = []
        for g in grads:
            norm = torch.linalg.vector_norm(g.detach(), 2.0, dtype=torch.float32)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms else torch.zeros(())
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.detach().mul_(scale.to(g.dtype))
        return total


def apply_tensor_parallel(model: torch.nn.Module, tp_size: int, device: torch.device) -> TensorParallel:
    """Shard `model`'s planned Linear layers over the `tp_size` processes of this process's group with its diffusers
    plan (`_tp_plan`); world size / `tp_size` groups side by side (the "dp" dimension of the mesh)."""
    import torch.distributed as dist
    from diffusers.hooks.tensor_parallel import _resolve_tp_plan, _styles
    from library.core.errors import UserError
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    flag = f"--tensor_parallel_size {tp_size}"
    plan = getattr(type(model), "_tp_plan", None)
    if not plan:
        raise UserError(f"{flag}: {type(model).__name__} has no tensor-parallel plan")
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    if heads is not None and heads % tp_size:
        raise UserError(f"{flag}: the denoiser's {heads} attention heads do not divide by it")
    expanded = _expanded_plan(model, plan)
    styles = {}
    for name, style in expanded.items():
        linear = model.get_submodule(name)
        weight = getattr(linear, "weight", None)
        if type(linear) is not torch.nn.Linear or weight is None or not weight.dtype.is_floating_point \
                or weight.element_size() < 2:
            raise UserError(f"{flag}: {name} is a {type(linear).__name__} of "
                            f"{getattr(weight, 'dtype', None)}: a quantized or float8 base cannot be sharded")
        dim = 0 if style == "colwise" or "Colwise" in type(style).__name__ else 1
        if weight.shape[dim] % tp_size:
            raise UserError(f"{flag}: {name}'s {weight.shape[dim]} {'rows' if dim == 0 else 'columns'} do not "
                            "divide by it")
        styles[id(linear)] = (name, style, linear)
    dp_size = dist.get_world_size() // tp_size
    mesh = init_device_mesh(device.type, (dp_size, tp_size), mesh_dim_names=("dp", "tp"))
    tp_mesh = mesh["tp"]
    for block, relative in _resolve_tp_plan(model, plan):
        parallelize_module(block, tp_mesh, _styles(relative))
    return TensorParallel(tp_mesh, styles, mesh.get_group("dp") if dp_size > 1 else None, dp_size)
