"""--gradient_checkpointing_policy: selective checkpointing recomputes fewer operators and gives full's gradients.

The selective policies (library/train/memory/checkpoint_policy.py) save the outputs of some operators and
recompute the rest from them: the recomputed operators are the same kernels on the same inputs, so the gradients
are bitwise those of full checkpointing (and of no checkpointing) on the CPU. That the policy is in effect is
checked by counting the forward operators that run again inside backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from library.cli.memory import gradient_checkpointing_wanted, memory_options_from_args
from library.core.errors import ConfigError
from library.families import get_family
from library.train.memory.checkpoint_policy import ATTENTION_OPS
from library.train.memory.offload_checkpoint import enable_gradient_checkpointing

CONV = (torch.ops.aten.convolution.default,)
MATMUL = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


class _Count(TorchDispatchMode):
    """How many times each operator overload runs."""

    def __init__(self):
        super().__init__()
        self.calls: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func] = self.calls.get(func, 0) + 1
        return func(*args, **(kwargs or {}))

    def count(self, ops) -> int:
        return sum(self.calls.get(op, 0) for op in ops)


def _sd1_loss(unet):
    torch.manual_seed(1)
    side = unet.config.sample_size
    x = torch.randn(1, unet.config.in_channels, side, side)
    text = torch.randn(1, 77, unet.config.cross_attention_dim)
    return lambda: F.mse_loss(unet(x, torch.tensor([500]), text, return_dict=False)[0], x)


def _flux_loss(transformer):
    from library.families.flux.family import image_ids, pack_latents

    torch.manual_seed(1)
    cfg = transformer.config
    x = pack_latents(torch.randn(1, cfg.in_channels // 4, 8, 8))
    kwargs = dict(encoder_hidden_states=torch.randn(1, 8, cfg.joint_attention_dim),
                  pooled_projections=torch.randn(1, cfg.pooled_projection_dim), timestep=torch.tensor([0.5]),
                  img_ids=image_ids(8, 8, torch.device("cpu"), torch.float32), txt_ids=torch.zeros(8, 3),
                  guidance=torch.ones(1) if cfg.guidance_embeds else None, return_dict=False)
    return lambda: F.mse_loss(transformer(hidden_states=x, **kwargs)[0], x)


def _grads(model, loss, policy):
    """(gradients of every parameter, the operator counts of the forward, of the backward) under `policy`
    (None: no checkpointing)."""
    model.zero_grad(set_to_none=True)
    if policy is None:
        model.disable_gradient_checkpointing()
        model.train()
    else:
        enable_gradient_checkpointing(model, False, policy)
    with _Count() as forward:
        value = loss()
    with _Count() as backward:
        value.backward()
    model.disable_gradient_checkpointing()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, forward, backward


@pytest.fixture
def sd1_unet(tiny_sd1_copy):
    return tiny_sd1_copy.denoiser.requires_grad_(True)


@pytest.fixture
def flux_transformer(tiny_flux_copy):
    return tiny_flux_copy.denoiser.requires_grad_(True)


@pytest.mark.parametrize("which", ["sd1", "flux"])
def test_selective_policies_give_full_checkpointings_gradients_bitwise(which, request):
    model = request.getfixturevalue("sd1_unet" if which == "sd1" else "flux_transformer")
    loss = (_sd1_loss if which == "sd1" else _flux_loss)(model)
    full, fwd, full_bwd = _grads(model, loss, "full")
    plain, _, plain_bwd = _grads(model, loss, None)
    n = len(full)
    assert n == len(plain) and all(full[k].abs().sum() > 0 for k in ("conv_in.weight",) if k in full)
    for policy in ("attention", "matmul"):
        grads, _, bwd = _grads(model, loss, policy)
        differing = [k for k in full if not torch.equal(grads[k], full[k])]
        assert differing == [], f"{policy}: {len(differing)} of {n} gradients differ from full, e.g. {differing[:3]}"
        # The policy is in effect: attention runs again in full's backward, never in a selective one's
        attention_in_forward = fwd.count(ATTENTION_OPS)
        assert attention_in_forward > 0
        assert full_bwd.count(ATTENTION_OPS) == attention_in_forward  # every block is checkpointed
        assert plain_bwd.count(ATTENTION_OPS) == 0
        assert bwd.count(ATTENTION_OPS) == 0
        if policy == "matmul":  # no matrix product or convolution of the forward runs again
            assert bwd.count(CONV) == 0
            # backward's own matrix products (the gradients of the Linear layers) are all that remain
            assert bwd.count(MATMUL) == plain_bwd.count(MATMUL) < full_bwd.count(MATMUL)
    # and the same gradients as no checkpointing at all (the same kernels, the same order)
    assert [k for k in full if not torch.equal(plain[k], full[k])] == []


def test_policy_flag_checks():
    sd, flux = get_family("sd"), get_family("flux")
    assert memory_options_from_args({}, sd).gradient_checkpointing_policy == "full"
    opts = memory_options_from_args({"gradient_checkpointing_policy": "matmul"}, flux)
    assert opts.gradient_checkpointing_policy == "matmul"
    assert gradient_checkpointing_wanted(opts, False)  # a selective policy turns checkpointing on
    full = memory_options_from_args({"gradient_checkpointing_policy": "full"}, sd)
    assert not gradient_checkpointing_wanted(full, False) and gradient_checkpointing_wanted(full, True)
    with pytest.raises(ConfigError, match=r"^--cpu_offload_checkpointing with --gradient_checkpointing_policy "
                                          r"attention: the offloaded checkpoint keeps only block inputs \(full\); "
                                          r"drop one of them$"):
        memory_options_from_args({"gradient_checkpointing_policy": "attention", "cpu_offload_checkpointing": True},
                                 flux)
    assert memory_options_from_args({"gradient_checkpointing_policy": "full", "cpu_offload_checkpointing": True},
                                    flux).cpu_offload_checkpointing
    with pytest.raises(ConfigError, match=r"^--gradient_checkpointing_policy: expected one of full, attention, "
                                          r"matmul, got 'some'$"):
        memory_options_from_args({"gradient_checkpointing_policy": "some"}, sd)


def test_sd1_training_with_a_selective_policy_is_full_checkpointings_run(tmp_path, caplog):
    """Through the CLI: the flag reaches the denoiser's blocks (the log line, and no attention recomputed in a
    step's backward), and the losses and the saved LoRA of a 2-step tiny run are bitwise those of
    --gradient_checkpointing."""
    import logging

    from safetensors.torch import load_file

    from tests.train_helpers import base_args, make_dataset, make_trainer

    data = make_dataset(str(tmp_path / "data"), n=2)

    def run(name, extra):
        trainer = make_trainer(base_args(data, str(tmp_path / name), "tiny:sd1", steps=2, extra=extra), "sd")
        losses, recomputed = [], []
        step = trainer._micro_step

        def counted(*a):
            with _Count() as ops:
                losses.append(step(*a))
            recomputed.append(ops.count(ATTENTION_OPS))
            return losses[-1]

        trainer._micro_step = counted
        return losses, load_file(trainer.run()), recomputed

    with caplog.at_level(logging.INFO):
        losses, lora, recomputed = run("matmul", ["--gradient_checkpointing_policy", "matmul"])
    assert "--gradient_checkpointing_policy matmul: checkpointed blocks keep the outputs of attention, matrix " \
           "products and convolutions" in caplog.text
    # matmul keeps the products' outputs, which the fused LoRA products would add into in place, so they are off
    # there (checkpoint_policy.keeps_products); the full run computes the same plain formula
    assert "fused LoRA products" not in caplog.text
    base_losses, base_lora, base_recomputed = run("full", ["--gradient_checkpointing", "--no_fused_lora"])
    assert len(losses) == 2 and losses == base_losses
    assert sorted(lora) == sorted(base_lora) and all(torch.equal(lora[k], base_lora[k]) for k in lora)
    # each step's attention calls (the text encoder's and the U-Net's; measured 45 under matmul): the U-Net's
    # 32 run again in full's backward only
    assert recomputed[0] > 32 and recomputed == [recomputed[0]] * 2
    assert [b - r for b, r in zip(base_recomputed, recomputed)] == [32, 32]
