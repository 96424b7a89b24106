"""flux_train.py specifics: --blockwise_fused_optimizers, and --blocks_to_swap over trained blocks (tiny:flux, CPU)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from library.cli.entry import run_training
from tests.train_helpers import ft_args, ft_trainer
from tests.train_helpers import assert_close_measured, make_dataset

# AdamW without clipping: per-parameter clipping (the fused modes) and the global norm would differ.
FLUX_FT = ["--t5xxl_max_token_length", "8", "--optimizer_type", "AdamW", "--max_grad_norm", "0"]


def _fused(trainer):
    opt = trainer.optimizer
    return opt.optimizer if hasattr(opt, "optimizer") else opt  # accelerate's wrapper


def test_blockwise_fused_optimizers_step_each_block_in_backward_and_equal_the_usual_adamw(tmp_path):
    data = make_dataset(str(tmp_path), n=1)
    usual = load_file(ft_trainer(ft_args(data, str(tmp_path / "a"), "tiny:flux", steps=3, extra=FLUX_FT), "flux").run())
    trainer = ft_trainer(ft_args(data, str(tmp_path / "b"), "tiny:flux", steps=3,
                                 extra=FLUX_FT + ["--blockwise_fused_optimizers"]), "flux")
    stepped, held = [], []
    trainer.s.hooks.append(lambda tr, event, step: held.append(
        sum(p.grad is not None for p in tr.trainable.module.parameters())) if event == "step" else None)

    def record_steps(tr, event, step):
        if event != "train_start":
            return
        for (inner, _), name in zip(_fused(tr).chunks, _fused(tr).chunk_names):
            real = inner.step
            inner.step = lambda *a, _real=real, _name=name, **k: (stepped.append(_name), _real(*a, **k))[1]

    trainer.s.hooks.insert(0, record_steps)
    blockwise = load_file(trainer.run())
    model = trainer.components.denoiser
    n_double, n_single = len(model.transformer_blocks), len(model.single_transformer_blocks)
    names = (["denoiser other"] + [f"denoiser double_blocks.{i}" for i in range(n_double)]
             + [f"denoiser single_blocks.{i}" for i in range(n_single)])
    opt = _fused(trainer)
    assert opt.chunk_names == names
    block_params = {id(p) for p in model.transformer_blocks[1].parameters()}
    chunk = opt.chunks[names.index("denoiser double_blocks.1")][1]
    assert len(chunk) == len(block_params) and all(id(p) in block_params for p, _ in chunk)
    # Each block's optimizer steps once per step, during backward: the last block first, the embedders last.
    assert stepped == 3 * (names[1:][::-1] + ["denoiser other"])
    assert held == [0, 0, 0]  # no gradient is left once backward is done
    # measured 0 with the AVX-512, AVX2 and default kernels (ATEN_CPU_CAPABILITY) (one float32 step of these weights
    # is ~1e-7); gradients rounded through float16 before each
    # block's step give 1.9e-3
    assert_close_measured(blockwise, usual, 1e-5, "blockwise fused vs usual AdamW: weights")


@pytest.mark.parametrize("family,preset,flags,error", [
    ("sdxl", "tiny:sdxl", ["--blockwise_fused_optimizers"],
     ("error: --blockwise_fused_optimizers: not for sdxl; it groups FLUX.1's double and single blocks "
      "(use --fused_backward_pass or --fused_optimizer_groups)")),
    ("flux", "tiny:flux", ["--blockwise_fused_optimizers", "--fused_backward_pass"],
     "error: --blockwise_fused_optimizers: not with --fused_backward_pass; choose one"),
    ("flux", "tiny:flux", ["--blockwise_fused_optimizers", "--gradient_accumulation_steps", "2"],
     ("error: --blockwise_fused_optimizers: gradients are applied during backward, so it cannot accumulate them; "
      "drop --gradient_accumulation_steps 2")),
])
def test_blockwise_fused_optimizers_refused_with_one_line(tmp_path, capsys, family, preset, flags, error):
    data = make_dataset(str(tmp_path), n=1)
    code = run_training(family, "test", ft_args(data, str(tmp_path / "o"), preset, extra=FLUX_FT[2:] + flags),
                        fine_tune=True)
    assert code == 2
    assert capsys.readouterr().err.strip() == error


@pytest.mark.parametrize("mode", [[], ["--blockwise_fused_optimizers"], ["--gradient_accumulation_steps", "2"]])
def test_blocks_to_swap_over_trained_blocks_trains_as_without(tmp_path, tiny_flux, mode):
    """Full fine-tune with --blocks_to_swap 2 (one double and two single blocks in offload memory): the same
    weights as without, the swapped blocks' updates included, whether the optimizer steps after backward
    (on the offload copies) or inside it (on the device copies, copied back)."""
    data = make_dataset(str(tmp_path), n=2)
    common = FLUX_FT + ["--gradient_checkpointing"] + mode
    want = load_file(ft_trainer(ft_args(data, str(tmp_path / "a"), "tiny:flux", steps=3, extra=common), "flux").run())
    trainer = ft_trainer(ft_args(data, str(tmp_path / "b"), "tiny:flux", steps=3,
                                 extra=common + ["--blocks_to_swap", "2"]), "flux")
    got = load_file(trainer.run())
    model = trainer.components.denoiser
    swapper = trainer.block_swapper
    assert swapper.swapped == [model.transformer_blocks[1], *model.single_transformer_blocks[1:]]
    assert swapper.write_back == (mode == ["--blockwise_fused_optimizers"])
    assert swapper.stats.loads > 0
    # measured at most 1.2e-7 (one float32 step of these weights) with the AVX-512, AVX2 and default kernels
    # (ATEN_CPU_CAPABILITY); a swapped block's update not copied
    # back (--blockwise_fused_optimizers) gives 3e-3
    assert_close_measured(got, want, 1e-5, f"blocks_to_swap {mode}: weights")
    swapped = model.transformer_blocks[1].attn.to_out[0].weight
    initial = tiny_flux.denoiser.transformer_blocks[1].attn.to_out[0].weight
    assert torch.equal(got["double_blocks.1.img_attn.proj.weight"], swapped.detach())  # the file holds the update
    assert (swapped.detach() - initial).abs().min() > 0  # every element of a swapped block's weight was updated
