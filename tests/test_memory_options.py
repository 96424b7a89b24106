"""Memory options (--blocks_to_swap, --fp8_base, --cpu_offload_checkpointing) train as without them.

Each option runs the same math as another computation (blocks copied to and from offload memory, saved inputs
recomputed by another autograd function, float8 weights upcast on the fly), so the results agree up to float
rounding, which depends on the CPU: compared with a tolerance set from the measured difference
(tests/train_helpers.py assert_close_measured)."""

from __future__ import annotations

import glob
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from library.cli.memory import memory_options_from_args
from library.core.errors import ConfigError, UserError
from library.families import get_family
from library.train.memory.block_swap import BlockSwapper
from library.train.memory.fp8 import FP8_DTYPE, cast_base_to_fp8, fp8_layers, fp8_round_trip_
from library.train.memory.offload_checkpoint import offloaded_checkpoint
from tests.train_helpers import assert_close_measured, base_args, largest_lora_up, make_dataset, make_trainer

FLUX_ARGS = ["--t5xxl_max_token_length", "16", "--network_train_unet_only", "--cache_text_encoder_outputs"]


def _train(tmp_path, name, preset, family, extra, steps=2, round_trip_fp8=None):
    """Losses of each micro step, the saved LoRA and the trainer of a tiny run; `round_trip_fp8`
    ("all" or "denoiser") rounds the base weights through float8 at load, as a reference."""
    data = make_dataset(str(tmp_path / "data"), n=2)
    trainer = make_trainer(base_args(data, str(tmp_path / name), preset, steps=steps, extra=extra), family)
    if round_trip_fp8:  # the reference for --fp8_base: weights already rounded through float8, kept as float32
        load = trainer.family.load

        def load_rounded(opts):
            c = load(opts)
            for m in [c.denoiser, *(c.text_encoders if round_trip_fp8 == "all" else [])]:
                fp8_round_trip_(m)
            return c

        trainer.family.load = load_rounded
    losses = []
    step = trainer._micro_step
    trainer._micro_step = lambda *a: losses.append(step(*a)) or losses[-1]
    path = trainer.run()
    return losses, load_file(path), trainer


# ---------------------------------------------------------------------------- block swap on a toy model
class _Toy(nn.Module):
    """Six frozen Linear blocks, each with a trainable low-rank adapter held outside the block (like our LoRA)."""

    def __init__(self, checkpoint=None):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(6)).requires_grad_(False)
        self.adapters = nn.ParameterList(nn.Parameter(torch.randn(8, 8) * 0.1) for _ in range(6))
        self.checkpoint = checkpoint
        for block, adapter in zip(self.blocks, self.adapters):
            block.forward = lambda x, b=block, a=adapter: torch.tanh(F.linear(x, b.weight, b.bias) + x @ a)

    def forward(self, x):
        for block in self.blocks:
            x = self.checkpoint(block, x) if self.checkpoint and torch.is_grad_enabled() else block(x)
        return x


def _plain_checkpoint(block, x):
    return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)


@pytest.mark.parametrize("checkpoint", [None, _plain_checkpoint, offloaded_checkpoint])
def test_block_swapper_residency_and_gradients(checkpoint):
    x = torch.randn(3, 8, requires_grad=True)
    reference = _Toy(checkpoint)
    reference(x).sum().backward()
    model = _Toy(checkpoint)
    swapper = BlockSwapper(list(model.blocks), 3, "cpu", "cpu", record=True)
    assert swapper.resident() == [0, 1, 2]
    out = model(x)
    assert swapper.resident() == [0, 1, 2]  # forward done: every swapped block is back in offload memory
    out.sum().backward()
    # The swapped blocks run on copies of their weights: measured 0 with the AVX-512, AVX2 and default kernels
    # (ATEN_CPU_CAPABILITY); float32 rounding of these 8-term sums would be ~1e-7. Copies through float16 give 5.9e-4
    assert_close_measured({i: a.grad for i, a in enumerate(model.adapters)},
                          {i: a.grad for i, a in enumerate(reference.adapters)}, 1e-6, "adapter gradients")
    events = [(kind, block) for kind, block, _ in swapper.stats.events]
    forward = [("forward", 3), ("forward", 4), ("forward", 5)]
    if checkpoint is None:
        assert events == forward + [("backward", 5), ("backward", 4), ("backward", 3)]
    elif checkpoint is _plain_checkpoint:  # brought back before its backward, which recomputes it
        assert events == forward + [("backward", 5), ("forward", 5), ("backward", 4), ("forward", 4),
                                    ("backward", 3), ("forward", 3)]
    else:  # recomputed (which brings it back), then its backward
        assert events == forward + [("forward", 5), ("backward", 5), ("forward", 4), ("backward", 4),
                                    ("forward", 3), ("backward", 3)]
    for _, block, resident in swapper.stats.events:
        assert block in resident  # a block runs only on the compute device
        assert len(resident) <= 6 - 3 + 1 + swapper.prefetch  # the others + the running one + one prefetched
    assert swapper.stats.max_resident == 2
    assert (swapper.stats.loads, swapper.stats.prefetches) == (6, 4)  # each swapped block in twice; 4 ahead of need
    assert swapper.resident() == [0, 1, 2]  # backward done: back in offload memory too
    with torch.no_grad():
        model(x)  # sampling / validation: forward only
    assert swapper.resident() == [0, 1, 2]


def test_a_block_whose_inputs_need_no_gradient_is_released_after_backward():
    model = _Toy()
    swapper = BlockSwapper(list(model.blocks), 6, "cpu", "cpu")
    model(torch.randn(3, 8)).sum().backward()  # block 0's input needs no gradient: no node drops it
    assert swapper.resident() == [0]
    swapper.release()  # what the trainer does after each backward
    assert swapper.resident() == []


# ---------------------------------------------------------------------------- FLUX.1: swap and offload
def test_flux_block_swap_and_cpu_offload_checkpointing_train_as_without(tmp_path):
    base_losses, base_lora, _ = _train(tmp_path, "plain", "tiny:flux", "flux", FLUX_ARGS)
    for name, extra in [("checkpointing", ["--gradient_checkpointing"]),
                        ("swap_checkpointing", ["--gradient_checkpointing", "--blocks_to_swap", "2"]),
                        ("swap", ["--blocks_to_swap", "1"]),
                        ("offload", ["--cpu_offload_checkpointing"]),
                        ("offload_swap", ["--cpu_offload_checkpointing", "--blocks_to_swap", "2"])]:
        losses, lora, trainer = _train(tmp_path, name, "tiny:flux", "flux", FLUX_ARGS + extra)
        # measured 0 and 0 for every variant with the AVX-512, AVX2 and default kernels (ATEN_CPU_CAPABILITY). Swapped
        # weights copied through float16 give 1.6e-3 (LoRA), saved inputs through float16 2.8e-3 (LoRA), dropped
        # input gradients 3.2e-4 (losses)
        assert_close_measured(losses, base_losses, 1e-5, f"{name}: losses")
        assert_close_measured(lora, base_lora, 1e-4, f"{name}: LoRA")
        swapper = trainer.block_swapper
        if swapper is not None:
            blocks = trainer.components.denoiser
            expected = [blocks.transformer_blocks[1]] if "2" in extra else []
            assert swapper.swapped == expected + list(blocks.single_transformer_blocks[1:])
            assert all(p.device.type == "cpu" for b in swapper.swapped for p in b.parameters())
    assert len(base_losses) == 2 and base_losses[0] != base_losses[1]


def test_flux_swap_rule_and_bound():
    family = get_family("flux")
    model = SimpleNamespace(transformer_blocks=[f"d{i}" for i in range(19)],
                            single_transformer_blocks=[f"s{i}" for i in range(38)])
    comps = SimpleNamespace(denoiser=model)
    assert family.swappable_blocks(comps, 1) == ["s36", "s37"]
    assert family.swappable_blocks(comps, 2) == ["d18", "s36", "s37"]
    blocks = family.swappable_blocks(comps, 35)  # 17 double, 36 single
    assert (blocks[0], blocks[16], blocks[17], len(blocks)) == ("d2", "d18", "s2", 53)
    assert len(family.swappable_blocks(comps, 38)) == 19 + 38
    with pytest.raises(ConfigError, match=r"^--blocks_to_swap 39: expected 1\.\.38 for this model \(19 double "
                                          r"and 38 single blocks; N swaps N//2 double and 2\*\(N-N//2\) single ones\)$"):
        family.swappable_blocks(comps, 39)


# ---------------------------------------------------------------------------- fp8
def test_fp8_layers_keep_names_dtype_and_lora_wrapping():
    layer = nn.Sequential(nn.Linear(4, 3), nn.Conv2d(2, 2, 3, padding=1)).requires_grad_(False)
    keys = sorted(layer.state_dict())
    assert cast_base_to_fp8(layer) == 2 and fp8_layers([layer]) == 2
    assert sorted(layer.state_dict()) == keys
    assert layer[0].weight.dtype == FP8_DTYPE and layer[0].bias.dtype == torch.float32
    assert [n for n, _ in layer.named_parameters()] == ["0.bias", "1.bias"]  # model.dtype reads a float32 bias
    t5 = nn.Module()
    t5._keep_in_fp32_modules = ["wo"]
    t5.wi, t5.wo = nn.Linear(2, 2).requires_grad_(False), nn.Linear(2, 2).requires_grad_(False)
    assert cast_base_to_fp8(t5) == 1 and t5.wo.weight.dtype == torch.float32


def test_fp8_sd1_trains_as_float8_rounded_weights(tmp_path):
    fp8_losses, fp8_lora, trainer = _train(tmp_path, "fp8", "tiny:sd1", "sd", ["--fp8_base"])
    rounded_losses, rounded_lora, _ = _train(tmp_path, "rounded", "tiny:sd1", "sd", [], round_trip_fp8="all")
    full_losses, _, _ = _train(tmp_path, "full", "tiny:sd1", "sd", [])
    # Same forward; the float8 layers' own backward and the order gradients of a shared input are summed in may
    # differ from autograd's: measured 0 and 0 with the AVX-512, AVX2 and default kernels (ATEN_CPU_CAPABILITY).
    # A float8 layer dropping its bias gives 2.7e-3 (losses), its input gradient rounded through float16 1.8e-3 (LoRA)
    assert_close_measured(fp8_losses, rounded_losses, 1e-5, "fp8 vs rounded: losses")
    assert_close_measured(fp8_lora, rounded_lora, 1e-4, "fp8 vs rounded: LoRA")
    assert fp8_losses != full_losses
    torch.testing.assert_close(torch.tensor(fp8_losses), torch.tensor(full_losses), rtol=0.02, atol=0)
    c = trainer.components
    assert (fp8_layers([c.denoiser]), fp8_layers(c.text_encoders)) == (282, 72)
    assert c.denoiser.dtype == torch.float32


def test_fp8_flux_with_block_swap_samples_and_validates(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat --w 64 --h 64 --s 1 --d 5\n")
    validation = ["--validation_split", "0.5", "--validate_every_n_steps", "1"]
    losses, lora, trainer = _train(tmp_path, "fp8", "tiny:flux", "flux", FLUX_ARGS + validation + [
        "--fp8_base_unet", "--gradient_checkpointing", "--blocks_to_swap", "2",
        "--sample_prompts", str(prompts), "--sample_at_first"])
    rounded_losses, rounded_lora, _ = _train(tmp_path, "rounded", "tiny:flux", "flux", FLUX_ARGS + validation,
                                             round_trip_fp8="denoiser")
    # measured 0 and 0 (all three kernel sets); a dropped bias gives 3.5e-2 (losses), swapped weights copied through
    # float16 2e-4 (LoRA), a float16-rounded input gradient 1.1e-3 (LoRA)
    assert_close_measured(losses, rounded_losses, 1e-5, "fp8 + swap vs rounded: losses")
    assert_close_measured(lora, rounded_lora, 1e-4, "fp8 + swap vs rounded: LoRA")
    names = sorted(os.path.basename(p)[:16] for p in glob.glob(os.path.join(str(tmp_path / "fp8"), "sample", "*.png")))
    assert names == ["lora_e000000_00_", "lora_e000000_gri"]  # the sample before training, and its grid
    c = trainer.components
    assert fp8_layers([c.denoiser]) > 0 and fp8_layers(c.text_encoders) == 0  # --fp8_base_unet


# ---------------------------------------------------------------------------- flags
def test_memory_flag_checks():
    sd, flux = get_family("sd"), get_family("flux")
    from library.cli.memory import gradient_checkpointing_wanted

    opts = memory_options_from_args({"cpu_offload_checkpointing": True}, flux)
    assert opts.cpu_offload_checkpointing and gradient_checkpointing_wanted(opts, False)  # turned on, as sd-scripts
    assert not gradient_checkpointing_wanted(memory_options_from_args({}, flux), False)
    assert memory_options_from_args({"fp8_base_unet": True}, sd).fp8_base  # implies --fp8_base
    with pytest.raises(ConfigError, match=r"^--blocks_to_swap: expected an integer >= 1, got 0$"):
        memory_options_from_args({"blocks_to_swap": 0}, flux)
    assert memory_options_from_args({"cpu_offload_checkpointing": True}, sd).cpu_offload_checkpointing  # any family


def test_sd1_cpu_offload_checkpointing_trains_as_plain_checkpointing(tmp_path):
    """The UNet's checkpointed blocks (ResNet and transformer blocks) with their saved inputs in CPU memory:
    the losses and LoRA of plain gradient checkpointing up to the order in which backward sums a tensor's gradients
    (the text states and time embedding every block takes), which AdamW's first steps magnify; the second loss
    follows from the first step's LoRA (it differed in the last bit on a 2-core AMD EPYC)."""
    base_losses, base_lora, _ = _train(tmp_path, "plain", "tiny:sd1", "sd", ["--gradient_checkpointing"])
    losses, lora, _ = _train(tmp_path, "offload", "tiny:sd1", "sd", ["--cpu_offload_checkpointing"])
    # measured 1.2e-7 (AVX-512 kernels) and 0 (AVX2, default: ATEN_CPU_CAPABILITY); dropped input gradients give
    # 3.5e-4
    assert_close_measured(losses, base_losses, 1e-5, "offload vs plain: losses")
    # measured 3.6e-6 (AVX-512), 4.3e-5 (AVX2), 4.1e-5 (default); saved inputs rounded through float16 give 1.9e-3
    assert_close_measured(lora, base_lora, 4e-4, "offload vs plain: LoRA")
    assert largest_lora_up(base_lora) > 1e-3  # trained: two AdamW steps of 1e-3 move it 2e-3
    assert len(base_losses) == 2 and base_losses[0] != base_losses[1]


@pytest.mark.parametrize("family, preset, extra, message", [
    ("sd", "tiny:sd1", ["--blocks_to_swap", "2"], "error: --blocks_to_swap: not supported for sd (only DiT families"),
    ("flux", "tiny:flux", ["--blocks_to_swap", "60"], "error: --blocks_to_swap 60: expected 1..2 for this model "
                                                       "(2 double and 3 single blocks;"),
])
def test_memory_flag_errors_exit_2_with_one_line_before_the_data_is_read(tmp_path, capsys, family, preset, extra,
                                                                          message):
    from library.cli.entry import run_training

    no_data = str(tmp_path / "no_data_here")
    assert run_training(family, "test", base_args(no_data, str(tmp_path / "out"), preset, steps=1, extra=extra)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err


def test_swapped_blocks_are_page_locked_at_their_exact_size(monkeypatch):
    """On CUDA each swapped block's weights sit in one buffer registered with cudaHostRegister (mocked here)."""
    from unittest import mock

    from library.train.memory.block_swap import page_locked_copies

    tensors = [torch.randn(3, 5).bfloat16(), torch.randn(7), torch.tensor(2.0), torch.arange(10)]
    cudart = mock.Mock()
    cudart.cudaHostRegister.return_value = 0
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    buffer, copies = page_locked_copies(tensors)
    assert all(torch.equal(a, b) and a.dtype == b.dtype and a.shape == b.shape for a, b in zip(tensors, copies))
    assert all(c.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() for c in copies)
    assert buffer.numel() == 4 * 256  # each copy starts on a 256-byte boundary
    cudart.cudaHostRegister.assert_called_once_with(buffer.data_ptr(), 1024, 0)
    cudart.cudaHostRegister.return_value = 2  # cudaErrorMemoryAllocation
    with pytest.raises(UserError, match=r"^--blocks_to_swap: cannot page-lock 0 MiB of host memory"):
        page_locked_copies(tensors)


def test_parts_whose_outputs_are_cached_wait_in_cpu_memory():
    from types import SimpleNamespace

    from library.train.memory.memory_setup import park_cached_parts

    vae, te1, te2 = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    components = SimpleNamespace(vae=vae, text_encoders=[te1, te2])
    assert park_cached_parts(components, "cuda", True, {0, 1}) == ["VAE", "text encoder 1", "text encoder 2"]
    assert park_cached_parts(components, "cuda", False, {1}) == ["text encoder 2"]  # encoder 1 trains
    assert park_cached_parts(components, "cpu", True, {0, 1}) == []  # nothing to free
