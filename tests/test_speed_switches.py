"""--torch_compile (regional, per block), --flash_attn / --xformers fallbacks: they apply, or say why not."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from safetensors.torch import load_file

from library.core.errors import ConfigError
from tests.train_helpers import assert_close_measured, base_args, largest_lora_up, make_dataset, make_trainer


def _lora(tmp_path, name: str, extra: list[str]) -> dict[str, torch.Tensor]:
    data = make_dataset(str(tmp_path / "data"), n=2)
    out = str(tmp_path / name)
    make_trainer(base_args(data, out, steps=3, extra=["--cache_latents", "--network_train_unet_only",
                                                      "--gradient_checkpointing"] + extra)).run()
    return load_file(os.path.join(out, "lora.safetensors"))


def test_regional_compile_trains_the_same_lora(tmp_path, caplog):
    """aot_eager runs dynamo + AOTAutograd (the compiled forward and backward graphs) without inductor's C++
    build: the compiled blocks must train the LoRA the eager ones train."""
    torch._dynamo.reset()
    eager = _lora(tmp_path, "eager", [])
    with caplog.at_level(logging.INFO, logger="library.train.memory.compile"):
        compiled = _lora(tmp_path, "compiled", ["--torch_compile", "--dynamo_backend", "aot_eager"])
    (line,) = [r.getMessage() for r in caplog.records if "--torch_compile" in r.getMessage()]
    # tiny:sd1: 2 down + 2 up/mid transformer blocks and the ResNet blocks, compiled one by one
    assert line.startswith("--torch_compile: ") and " blocks of UNet2DConditionModel compiled (aot_eager" in line
    assert int(line.split()[1]) >= 8
    # AOTAutograd's decomposed graphs round otherwise: measured 6.3e-6, 3.4e-6, 2.9e-6 with the AVX-512, AVX2 and
    # default kernels (ATEN_CPU_CAPABILITY), 1.6x under the 1e-5 bound it had;
    # blocks compiled over float16-rounded weights give 2.9e-3
    assert_close_measured(compiled, eager, 1e-4, "compiled vs eager: LoRA")
    assert largest_lora_up(eager) > 1e-4
    torch._dynamo.reset()


@pytest.mark.parametrize("flags, message", [
    (["--torch_compile", "--dynamo_backend", "nope"], "--dynamo_backend: expected one of "),
    (["--torch_compile", "--dynamo_backend", "eager", "--dynamo_mode", "max-autotune"],
     "--dynamo_mode max-autotune: an inductor option"),
    (["--xformers", "--flash_attn"], "--xformers and --flash_attn: choose one"),
])
def test_bad_combinations_named(tmp_path, flags, message):
    data = make_dataset(str(tmp_path), n=1)
    with pytest.raises(ConfigError, match=message):
        make_trainer(base_args(data, str(tmp_path / "o"), steps=1, extra=flags))


def test_compile_with_block_swap_refused(tmp_path):
    data = make_dataset(str(tmp_path), n=1)
    argv = base_args(data, str(tmp_path / "o"), preset="tiny:flux", steps=1,
                     extra=["--torch_compile", "--blocks_to_swap", "1"])
    with pytest.raises(ConfigError, match="--torch_compile with --blocks_to_swap"):
        make_trainer(argv, "flux")


def test_flash_attn_without_the_package_warns_and_uses_sdpa(tiny_sd1, caplog, monkeypatch):
    import importlib.util

    from library.train.memory import memory_setup

    real = importlib.util.find_spec
    monkeypatch.setattr(memory_setup.importlib.util, "find_spec",
                        lambda name, *a: None if name == "flash_attn" else real(name, *a))
    with caplog.at_level(logging.WARNING):
        assert memory_setup.apply_flash_attention(tiny_sd1) is False
    assert memory_setup.FLASH_MISSING in caplog.text
    # with the package "present" but no CUDA here, diffusers refuses the backend: one warning, SDPA stays
    monkeypatch.setattr(memory_setup.importlib.util, "find_spec", lambda name, *a: object())
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert memory_setup.apply_flash_attention(tiny_sd1) is False
    assert "--flash_attn: cannot use FlashAttention (" in caplog.text


def test_highvram_keeps_cached_parts_on_the_device(tmp_path, monkeypatch):
    from library.train import trainer as trainer_module

    calls = []
    monkeypatch.setattr(trainer_module, "park_cached_parts", lambda *a, **k: calls.append(a) or [])
    data = make_dataset(str(tmp_path / "data"), n=1)
    for name, extra in (("default", []), ("high", ["--highvram"])):
        make_trainer(base_args(data, str(tmp_path / name), steps=1, extra=["--cache_latents", *extra])).run()
    assert len(calls) == 1  # the default run parks the VAE (cached latents); --highvram does not
