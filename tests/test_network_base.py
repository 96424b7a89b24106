"""networks/network_base.py: the sd-scripts network interface every `--network_module` shares (LoRA, DyLoRA,
OFT on tiny SD 1.x): multiplier, hooks, and its files, written atomically in either format and read back, with a
one-line error for a file that is missing or damaged."""

from __future__ import annotations

import os

import pytest
import torch

from library.core.errors import UserError
from networks import dylora, lora, oft
from networks.network_base import AdapterNetwork, load_state_dict

MODULES = {"networks.lora": lora, "networks.dylora": dylora, "networks.oft": oft}


def _unet_out(c) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        return c.denoiser(torch.randn(1, 4, 8, 8, generator=g), torch.tensor([500]),
                          torch.randn(1, 77, 32, generator=g)).sample


def _network(module, c) -> AdapterNetwork:
    network = module.create_network(1.0, 4, 1.0 if module is not oft else 1e-3, c.vae, c.text_encoders[0], c.denoiser)
    network.apply_to(c.text_encoders[0], c.denoiser, apply_text_encoder=False, apply_unet=True)
    with torch.no_grad():  # move every trained tensor off its initial value (LoRA's up and OFT's blocks start at 0)
        g = torch.Generator().manual_seed(1)
        for p in network.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return network.eval()  # DyLoRA trains a random rank per step; eval uses them all


@pytest.mark.parametrize("name", sorted(MODULES))
def test_the_shared_interface_hooks_scales_and_unhooks(name, tiny_sd1_copy):
    c = tiny_sd1_copy
    base = _unet_out(c)
    network = _network(MODULES[name], c)
    assert isinstance(network, AdapterNetwork) and len(network.adapters()) > 0
    hooked = _unet_out(c)
    assert not torch.allclose(hooked, base)
    network.set_multiplier(0.0)
    assert network.multiplier == 0.0 and {m.multiplier for m in network.adapters()} == {0.0}
    # Bitwise, on any CPU: at multiplier 0 a LoRA adds exact zeros to the frozen layer's own output, and OFT's
    # rotation is exactly I (0 * (R - I) + I), so each weight is 1 * w plus exact zeros: the frozen product itself.
    torch.testing.assert_close(_unet_out(c), base, rtol=0, atol=0)
    network.set_multiplier(1.0)
    torch.testing.assert_close(_unet_out(c), hooked, rtol=0, atol=0)  # the same ops again, in the same order
    network.prepare_grad_etc(c.text_encoders[0], c.denoiser)
    network.on_epoch_start(c.text_encoders[0], c.denoiser)
    assert network.training and all(p.requires_grad for p in network.get_trainable_params())
    network.restore()
    torch.testing.assert_close(_unet_out(c), base, rtol=0, atol=0)  # unhooked: the base forward itself


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
@pytest.mark.parametrize("name", sorted(MODULES))
def test_files_are_written_atomically_in_the_save_precision_and_read_back(name, suffix, tiny_sd1_copy, tmp_path):
    c = tiny_sd1_copy
    network = _network(MODULES[name], c)
    want = network.state_dict()
    path = str(tmp_path / f"net{suffix}")
    old = os.umask(0o027)
    try:
        network.save_weights(path, torch.bfloat16, {"ss_network_module": name})
    finally:
        os.umask(old)
    assert os.listdir(tmp_path) == [f"net{suffix}"]  # nothing left beside it
    assert os.stat(path).st_mode & 0o777 == 0o640  # the user's umask
    got = load_state_dict(path)
    assert sorted(got) == sorted(want)
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    assert all(torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)  # the one cast the save makes
    network.restore()


def test_a_missing_or_damaged_file_is_one_line_naming_it(tmp_path):
    missing = str(tmp_path / "nope.safetensors")
    with pytest.raises(UserError, match=rf"^{missing}: file not found$"):
        load_state_dict(missing)
    damaged = tmp_path / "bad.safetensors"
    damaged.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(UserError, match=rf"^{damaged}: not a readable safetensors file"):
        load_state_dict(damaged)
    for module in MODULES.values():  # the module-level function sd-scripts' network modules have
        assert module.load_state_dict is load_state_dict


@pytest.mark.parametrize("name", ["networks.dylora", "networks.oft"])
def test_a_pickle_save_that_fails_leaves_the_old_file_whole(name, tiny_sd1_copy, tmp_path, monkeypatch):
    """DyLoRA and OFT wrote .pt files with a bare torch.save; a failure halfway left half a file where the last
    good one was."""
    network = _network(MODULES[name], tiny_sd1_copy)
    path = str(tmp_path / "net.pt")
    network.save_weights(path, None, {})
    before = open(path, "rb").read()

    def fails_halfway(obj, f, *args, **kwargs):
        with open(f, "wb") as out:
            out.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", fails_halfway)
    with pytest.raises(OSError, match="disk full"):
        network.save_weights(path, None, {})
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["net.pt"] and open(path, "rb").read() == before
    network.restore()
