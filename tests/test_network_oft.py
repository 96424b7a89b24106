"""--network_module networks.oft: sd-scripts' OFT file layout on tiny SD 1.x, reload, hook and merge."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from tests.train_helpers import base_args, make_dataset, make_trainer

# Read from sd-scripts 48d368fa networks/oft.py: OFTNetwork targets the Linear layers inside every
# "CrossAttention" of the UNet (to_q, to_k, to_v, to_out.0), names them "oft_unet" + "." + module path with
# "." -> "_", and saves `oft_blocks` [dim, out/dim, out/dim] and `alpha` (0-dim) per module. The tiny SD 1.x
# UNet's transformer blocks and their widths (block_out_channels 32, 64, 128, 128):
TRANSFORMERS = {**{f"down_blocks_{b}_attentions_{a}": w for b, w in enumerate((32, 64, 128)) for a in range(2)},
                "mid_block_attentions_0": 128,
                **{f"up_blocks_{b}_attentions_{a}": w for b, w in ((1, 128), (2, 64), (3, 32)) for a in range(3)}}
EXPECTED = {f"oft_unet_{t}_transformer_blocks_0_{attn}_{proj}.{part}": ([4, w // 4, w // 4] if part == "oft_blocks"
                                                                        else [])
            for t, w in TRANSFORMERS.items() for attn in ("attn1", "attn2") for proj in ("to_q", "to_k", "to_v",
                                                                                          "to_out_0")
            for part in ("oft_blocks", "alpha")}


def unet_out(components):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        return components.denoiser(torch.randn(1, 4, 8, 8, generator=g), torch.tensor([500]),
                                   torch.randn(1, 77, 32, generator=g)).sample


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("oft")
    data = make_dataset(str(root), n=1)
    trainer = make_trainer(base_args(data, str(root / "out"), steps=2, extra=[
        "--network_module", "networks.oft", "--network_alpha", "1e-3", "--learning_rate", "1e-2"]))
    path = trainer.run()
    trainer.accelerator.unwrap_model(trainer.network).eval()
    return path, unet_out(trainer.components)


def test_file_has_sd_scripts_names_shapes_and_metadata(trained):
    path, _ = trained
    with safe_open(path, framework="pt") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        md = f.metadata()
        alphas = {float(f.get_tensor(k)) for k in f.keys() if k.endswith(".alpha")}
        moved = sum(bool(f.get_tensor(k).abs().max() > 0) for k in f.keys() if k.endswith(".oft_blocks"))
    assert len(EXPECTED) == 256
    assert shapes == EXPECTED
    assert len(alphas) == 1 and alphas.pop() == pytest.approx(1e-3)
    assert moved == 128  # training turned every block
    assert (md["ss_network_module"], md["ss_network_dim"], md["ss_network_alpha"]) == ("networks.oft", "4", "0.001")


def test_file_loads_with_no_missing_or_unexpected_key_and_reproduces_the_trained_output(trained, tiny_sd1_copy):
    from safetensors.torch import load_file

    from networks import oft

    path, want = trained
    c = tiny_sd1_copy
    base = unet_out(c)
    network, weights = oft.create_network_from_weights(1.0, path, c.vae, c.text_encoders[0], c.denoiser)
    network.apply_to(c.text_encoders[0], c.denoiser)
    info = network.load_state_dict(load_file(path), strict=True)
    assert (info.missing_keys, info.unexpected_keys) == ([], [])
    got = unet_out(c)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got, base)
    network.set_multiplier(0.0)
    torch.testing.assert_close(unet_out(c), base, rtol=0, atol=0)
    network.restore()


def test_merge_equals_the_hooked_network(trained, tiny_sd1_copy):
    from safetensors.torch import load_file

    from networks import oft

    path, want = trained
    c = tiny_sd1_copy
    network, weights = oft.create_network_from_weights(1.0, path, c.vae, c.text_encoders[0], c.denoiser)
    network.merge_to(c.text_encoders[0], c.denoiser, load_file(path))
    torch.testing.assert_close(unet_out(c), want, rtol=1e-4, atol=1e-5)


def test_rotation_is_orthogonal_and_identity_at_multiplier_zero():
    from networks.oft import block_rotation

    blocks = torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(0)) * 0.1
    r = block_rotation(blocks, constraint=10.0, multiplier=1.0)
    torch.testing.assert_close(r @ r.transpose(1, 2), torch.eye(8).expand(4, 8, 8), rtol=0, atol=1e-5)
    torch.testing.assert_close(block_rotation(blocks, 10.0, 0.0), torch.eye(8).expand(4, 8, 8), rtol=0, atol=0)


def test_merge_lora_tool_merges_an_oft_file_into_the_model(trained, tmp_path):
    """tools/merge_lora.py takes the file by sd-scripts' OFT rule (constraint alpha·out_dim), not LyCORIS' OFT."""
    from tools.lora_models import load_model
    from tools.merge_lora import main

    path, want = trained
    out = str(tmp_path / "merged.safetensors")
    assert main(["--sd_model", "tiny:sd1", "--models", path, "--save_to", out]) == 0
    torch.testing.assert_close(unet_out(load_model(out, "sd").components), want, rtol=1e-4, atol=1e-5)


def test_sdxl_oft_file_uses_sd_scripts_sgm_names(tmp_path):
    """sd-scripts' SDXL UNet names its blocks SGM-style, so its OFT files do (`oft_unet_input_blocks_4_1_...`)."""
    import re

    from networks.oft import target_layers

    data = make_dataset(str(tmp_path), n=1)
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), preset="tiny:sdxl", steps=1, extra=[
        "--network_module", "networks.oft", "--network_train_unet_only", "--bucket_reso_steps", "32"]), "sdxl")
    with safe_open(trainer.run(), framework="pt") as f:
        names = sorted({k.split(".")[0] for k in f.keys()})
    attention = [n for n, m in trainer.components.denoiser.named_modules() if type(m).__name__ == "Attention"]
    assert len(names) == 4 * len(attention) and len(names) == len(target_layers(trainer.components.denoiser,
                                                                                 False, False))
    sgm = re.compile(r"^oft_unet_(input_blocks_\d+_1|middle_block_1|output_blocks_\d+_1)_transformer_blocks_\d+_"
                     r"attn[12]_to_(q|k|v|out_0)$")
    assert [n for n in names if not sgm.match(n)] == []
    assert "oft_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q" in names


def test_resize_to_lora_refactors_an_oft_file_with_the_base_model(trained, tmp_path, capsys):
    """The rank-r LoRA of an OFT file: lora_unet_ names, and the SVD truncation error of ΔW = merged − base."""
    from safetensors.torch import load_file

    from networks.lora_math import delta_weight
    from tools.lora_models import load_model, lora_layers
    from tools.merge_lora import main as merge
    from tools.resize_lora import main as resize

    path, _ = trained
    out, merged = str(tmp_path / "r.safetensors"), str(tmp_path / "m.safetensors")
    assert resize(["--model", path, "--to_lora", "--new_rank", "4", "--save_to", out]) == 2
    assert "an OFT (networks.oft) module: its ΔW depends on the base model's weight" in capsys.readouterr().err
    assert resize(["--model", path, "--to_lora", "--new_rank", "4", "--base_model", "tiny:sd1", "--save_to", out]) == 0
    assert merge(["--sd_model", "tiny:sd1", "--models", path, "--save_to", merged]) == 0
    base, after = lora_layers(load_model("tiny:sd1", "sd")), lora_layers(load_model(merged, "sd"))
    state = load_file(out)
    names = sorted({k.split(".")[0] for k in state})
    assert len(names) == 128 and all(n.startswith("lora_unet_") for n in names)
    for name in names:
        dw = (after[name].weight - base[name].weight).detach().reshape(after[name].weight.shape[0], -1)
        got = delta_weight(state[f"{name}.lora_down.weight"], state[f"{name}.lora_up.weight"],
                           state[f"{name}.alpha"]).reshape(dw.shape)
        best = float(torch.linalg.svdvals(dw.double())[4:].square().sum().sqrt())
        assert abs(float((got - dw).norm()) - best) <= 1e-4 * float(dw.norm()) + 1e-6, name
