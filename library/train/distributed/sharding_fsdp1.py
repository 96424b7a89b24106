"""FSDP1 (`torch.distributed.fsdp.FullyShardedDataParallel`, flat parameters) with the knobs of an accelerate
`fsdp_version: 1` config: sharding strategy, CPU offload, backward / forward prefetch, limit_all_gathers, the
wrap policy. `use_orig_params` is always on here: a LoRA's frozen base weights and trained LoRA weights share
a block, and saving reads the original parameters.

The units are wrapped in place (each replaced in its parent by its FullyShardedDataParallel), so the families keep
calling their models as before: the family's blocks (TRANSFORMER_BASED_WRAP) or subtrees of at least
`min_num_params` parameters (SIZE_BASED_WRAP), and then every module outside those units that holds parameters
of its own (a UNet's conv_in, time embedding, norms), which FSDP1 has no root unit for. Runs on CPU processes
(gloo) as on GPUs; PyTorch's own `sync_module_states` needs GPUs, so states are broadcast by
`sharding.broadcast_module_states` before wrapping instead.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from library.core.errors import ConfigError


def leftover_owners(part: torch.nn.Module, units: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Modules of `part` outside every unit that hold parameters of their own (FSDP1 wraps each)."""
    inside = {id(m) for u in units for m in u.modules()}
    out = []
    for m in part.modules():
        if id(m) in inside or not any(True for _ in m.parameters(recurse=False)):
            continue
        if m is part:
            raise ConfigError(f"FSDP1: {type(part).__name__} holds parameters of its own outside its blocks; use "
                              "fsdp_version 2")
        out.append(m)
    return out


class Fsdp1:
    """The FullyShardedDataParallel units of a run and how the trainable gathers its weights through them."""

    def __init__(self, device: torch.device):
        self.device = device
        self.wrapped: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []  # (parent, name, wrapper)

    def wrap(self, part: torch.nn.Module, units: list[torch.nn.Module], s) -> int:
        """Replace each unit of `part` (innermost first) in its parent by its FullyShardedDataParallel."""
        from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, ShardingStrategy
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        parent_of = {id(child): (m, name) for m in part.modules() for name, child in m.named_children()}
        prefetch = None if s.backward_prefetch == "NO_PREFETCH" else BackwardPrefetch[s.backward_prefetch]
        kwargs = dict(sharding_strategy=ShardingStrategy[s.sharding_strategy],
                      cpu_offload=CPUOffload(offload_params=s.cpu_offload), backward_prefetch=prefetch,
                      forward_prefetch=s.forward_prefetch, limit_all_gathers=s.limit_all_gathers, use_orig_params=True,
                      device_id=torch.device("cpu") if self.device.type == "cpu" else self.device)
        for unit in units:
            parent, name = parent_of[id(unit)]
            wrapper = FSDP(unit, **kwargs)
            setattr(parent, name, wrapper)
            parent_of[id(wrapper)] = (parent, name)
            self.wrapped.append((parent, name, wrapper))
        return len(units)

    @staticmethod
    def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole gradient: each process holds a disjoint piece of every flat parameter
        (use_orig_params views), so the squared norms of the pieces add up over the processes."""
        import torch.distributed as dist

        grads = [p.grad for p in params if p.grad is not None]
        local = torch.stack([g.detach().float().square().sum() for g in grads]).sum() if grads else \
            torch.zeros((), device=params[0].device if params else "cpu")
        dist.all_reduce(local)
        total = local.sqrt()
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.device, g.dtype))
        return total

    @contextlib.contextmanager
    def _unwrapped(self) -> Iterator[None]:
        """The original modules back in their parents (their parameters as FSDP left them), outermost last."""
        for parent, name, wrapper in reversed(self.wrapped):
            setattr(parent, name, wrapper.module)
        try:
            yield
        finally:
            for parent, name, wrapper in self.wrapped:
                setattr(parent, name, wrapper)

    @contextlib.contextmanager
    def gathered(self, module: torch.nn.Module, keep: bool, writeback: bool = False) -> Iterator[None]:
        """Inside, the original parameters hold the whole weights (every process must enter) and the module tree
        is the original one, so state_dict() has the original names and gathers nothing itself. With `writeback`
        what is written into them is cut back into the shards on exit."""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with contextlib.ExitStack() as stack:
            for _, _, wrapper in self.wrapped:  # each unit's own parameters (nested units have theirs)
                stack.enter_context(FSDP.summon_full_params(wrapper, writeback=writeback, recurse=False))
            stack.enter_context(self._unwrapped())
            yield

    def local_state(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """`module.state_dict()` of this process's pieces, by the original names, gathering nothing (a state_dict()
        through FullyShardedDataParallel would all-gather: a collective one process alone must not start)."""
        with self._unwrapped():
            return module.state_dict()

    def full_shapes(self, module: torch.nn.Module) -> dict[str, torch.Size]:
        """The whole shapes of `module`'s tensors by name (each process holds a flat piece of each)."""
        shapes = {}
        for _, _, wrapper in self.wrapped:
            flat = wrapper._handle.flat_param if wrapper._handle is not None else None
            if flat is not None:
                shapes.update({id(p): shape for p, shape in zip(flat._params, flat._shapes)})
        with self._unwrapped():
            named = module.state_dict(keep_vars=True)
        return {name: shapes.get(id(t), t.shape) for name, t in named.items()}

    def _named_trained(self, module: torch.nn.Module, optimizer) -> list[tuple[str, torch.nn.Parameter]]:
        with self._unwrapped():
            names = {id(p): n for n, p in module.named_parameters()}
        return [(names[id(p)], p) for group in optimizer.param_groups for p in group["params"]]

    def _through_shards(self, module: torch.nn.Module, params: list[tuple[str, torch.nn.Parameter]], per_param: dict,
                        to_full: bool) -> dict:
        """Gather (to_full) or cut (not to_full) tensors shaped like the parameters, by parameter name, through FSDP's
        own gathering: each shard is written into its parameter's piece of the flat parameter, whose whole is then
        read (or the whole written and the piece read back). The parameters' values are restored after."""
        out: dict = {}
        with torch.no_grad():
            backup = [p.detach().clone() for _, p in params]
            if to_full:
                for name, p in params:
                    p.detach().copy_(per_param[name])
            with self.gathered(module, True, writeback=not to_full):
                for name, p in params:
                    if to_full:
                        out[name] = p.detach().clone().cpu()
                    else:
                        p.detach().copy_(per_param[name])
            for (name, p), old in zip(params, backup):
                if not to_full:
                    out[name] = p.detach().clone()
                p.detach().copy_(old)
        return out

    def full_state(self, module: torch.nn.Module, optimizer) -> tuple[dict[str, torch.Tensor], dict]:
        """(whole weights, whole optimizer state keyed by parameter name) for a state folder (FULL_STATE_DICT);
        every process must call it. A process whose piece of a parameter is empty holds no optimizer state for
        it, so the state's keys and scalars are agreed between the processes first."""
        import torch.distributed as dist

        opt = getattr(optimizer, "optimizer", optimizer)
        with self.gathered(module, True):
            weights = {k: v.detach().clone().cpu() for k, v in module.state_dict().items()}
        params = self._named_trained(module, opt)
        local = {n: {k: (None if torch.is_tensor(v) and v.shape == p.shape and v.dim() > 0 else v)
                     for k, v in opt.state.get(p, {}).items()} for n, p in params}
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)
        merged: dict[str, dict] = {}
        for entries in everyone:  # scalars ("step") from any process; None marks a per-element tensor
            for name, values in entries.items():
                for key, value in values.items():
                    if merged.setdefault(name, {}).get(key) is None:
                        merged[name][key] = value
        keys = sorted({k for values in merged.values() for k, v in values.items() if v is None})
        for key in keys:
            shaped = [(n, p) for n, p in params if key in merged.get(n, {}) and merged[n][key] is None]
            pieces = {n: opt.state.get(p, {}).get(key, torch.zeros_like(p)) for n, p in shaped}
            for name, value in self._through_shards(module, shaped, pieces, True).items():
                merged[name][key] = value
        groups = []
        for group in opt.param_groups:
            ids = {id(p) for p in group["params"]}
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": [n for n, p in params if id(p) in ids]})
        return weights, {"state": {n: v for n, v in merged.items() if v}, "param_groups": groups}

    def load_full_state(self, module: torch.nn.Module, optimizer, weights: dict[str, torch.Tensor],
                        optimizer_state: dict) -> None:
        """A state folder's whole weights and optimizer state, cut back into this process's shards."""
        opt = getattr(optimizer, "optimizer", optimizer)
        params = self._named_trained(module, opt)
        index = {name: i for i, (name, _) in enumerate(params)}
        state: dict[int, dict] = {}
        for name, entries in optimizer_state["state"].items():
            state[index[name]] = dict(entries)
        shaped_keys = sorted({k for entries in state.values() for k, v in entries.items()
                              if torch.is_tensor(v) and v.dim() > 0})
        for key in shaped_keys:
            todo = [(n, p) for n, p in params if n in optimizer_state["state"]
                    and torch.is_tensor(optimizer_state["state"][n].get(key))
                    and optimizer_state["state"][n][key].dim() > 0]
            cut = self._through_shards(module, todo, {n: optimizer_state["state"][n][key] for n, _ in todo}, False)
            for name, value in cut.items():
                state[index[name]][key] = value
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in optimizer_state["param_groups"]]
        opt.load_state_dict({"state": state, "param_groups": groups})
        with torch.no_grad(), self.gathered(module, True, writeback=True):
            own = module.state_dict()
            for key, value in weights.items():
                own[key].copy_(value)
