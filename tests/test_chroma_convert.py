"""Chroma LoRA files in the tools: converted by tools/convert_lora.py --to diffusers, one loads in diffusers'
ChromaPipeline with every key used and our networks.lora's outputs; tools/merge_lora.py merges one into a Chroma
single file (found as Chroma, not FLUX.1)."""

from __future__ import annotations

import copy

import torch
from safetensors.torch import load_file

from library.families import get_family
from library.families.base import LoadOptions
from library.families.chroma.family import joint_attention_mask
from library.families.flux.family import image_ids, pack_latents
from library.families.lora_convert import convert
from networks.lora import create_network, create_network_from_weights


def test_converted_chroma_lora_loads_in_chroma_pipeline_with_our_outputs():
    from diffusers import ChromaPipeline, FlowMatchEulerDiscreteScheduler

    family = get_family("chroma")
    c = family.load(LoadOptions("tiny:chroma"))
    net = create_network(1.0, 4, 2, c.vae, c.text_encoders, c.denoiser, lora_targets=family.lora_targets(c))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for lora in net.unet_loras:
            lora.lora_up.weight.copy_(torch.randn(lora.lora_up.weight.shape, generator=g) * 0.1)
    kohya = {k: v.detach().clone() for k, v in net.state_dict().items()}
    peft = convert(kohya, "diffusers", "chroma_lora.safetensors")
    # 2 double blocks x (img, txt) x (q, k, v, out, mlp 0, mlp 2) + 3 single blocks x (q, k, v, mlp, out)
    assert len(peft) == 2 * (2 * 2 * 6 + 3 * 5)
    back = convert(peft, "kohya", "peft")
    assert {k.split(".")[0] for k in back} == {k.split(".")[0] for k in kohya}

    pipe = ChromaPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=c.vae, text_encoder=c.text_encoders[0],
                          tokenizer=c.tokenizers[0], transformer=copy.deepcopy(c.denoiser))
    pipe.load_lora_weights(peft)
    assert len({n for n, m in pipe.transformer.named_modules() if hasattr(m, "lora_A")}) == len(peft) // 2

    ours, _ = create_network_from_weights(1.0, None, None, c.text_encoders, c.denoiser, weights_sd=kohya,
                                          lora_targets=family.lora_targets(c))
    ours.apply_to(c.text_encoders, c.denoiser, apply_text_encoder=False)
    ours.load_weights(kohya)
    latents, text = torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 6, c.denoiser.config.joint_attention_dim,
                                                                         generator=g)
    kwargs = dict(hidden_states=pack_latents(latents), encoder_hidden_states=text, timestep=torch.tensor([0.3, 0.8]),
                  img_ids=image_ids(8, 8), txt_ids=torch.zeros(6, 3),
                  attention_mask=joint_attention_mask(torch.tensor([[1] * 6, [1] * 3 + [0] * 3]), 16))
    with torch.no_grad():
        mine = c.denoiser(**kwargs).sample
        theirs = pipe.transformer(**kwargs).sample
    ours.restore()
    with torch.no_grad():
        plain = c.denoiser(**kwargs).sample
    torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)
    assert (mine - plain).abs().max() > 1e-3


def test_merge_lora_into_a_chroma_single_file(tmp_path):
    from library.families.chroma.model import load_chroma_transformer
    from tests.train_helpers import random_lora_file
    from tools import merge_lora
    from tools.make_tiny_model import main as make_tiny_model

    assert make_tiny_model(["--family", "chroma", "--out", str(tmp_path / "model"), "--single_file"]) == 0
    files = {name: str(tmp_path / "model" / f"{name}.safetensors") for name in ("chroma-tiny", "t5xxl", "ae")}
    family = get_family("chroma")
    c = family.load(LoadOptions("tiny:chroma"))
    lora = load_file(random_lora_file(family, c, str(tmp_path / "lora.safetensors")))  # dim 4, alpha 2
    merged = str(tmp_path / "merged.safetensors")
    assert merge_lora.main(["--sd_model", files["chroma-tiny"], "--t5xxl", files["t5xxl"], "--ae", files["ae"],
                            "--models", str(tmp_path / "lora.safetensors"), "--ratios", "1.0",
                            "--save_to", merged]) == 0
    got, base = load_chroma_transformer(merged).state_dict(), c.denoiser.state_dict()
    # the fused img_attn_qkv of double block 1: its three row blocks land on to_q, to_k, to_v
    name = "lora_unet_double_blocks_1_img_attn_qkv"
    delta = lora[f"{name}.lora_up.weight"] @ lora[f"{name}.lora_down.weight"] * (2 / 4)
    for i, proj in enumerate(("to_q", "to_k", "to_v")):
        key = f"transformer_blocks.1.attn.{proj}.weight"
        torch.testing.assert_close(got[key], base[key] + delta[i * 32:(i + 1) * 32], rtol=1e-5, atol=1e-5)
    assert sum(not torch.equal(got[k], base[k]) for k in base) == 39  # every LoRA'd projection, nothing else
