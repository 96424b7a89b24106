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


def _comfy_chroma_key_map(c) -> set[str]:
    """The LoRA names ComfyUI's loader (commit a125cd84, comfy/lora.py) maps onto a Chroma model, as data read from
    its code. model_lora_keys_unet: every `diffusion_model.<k>.weight` of the DiT (Chroma's own single-file names)
    as `lora_unet_<k with . -> _>` and as `diffusion_model.<k>`. model_lora_keys_clip: Chroma's text encoder is
    T5-XXL alone (`t5xxl.transformer.` + the T5 names of comfy/text_encoders/t5.py, which are transformers'); with
    no clip_l / clip_g the T5 index stays 1, so each weight is `lora_te1_<k with . -> _>`, and generically
    `text_encoders.t5xxl.transformer.<k>`."""
    from library.families.chroma.model import chroma_to_single_file

    dit = [k[:-len(".weight")] for k in chroma_to_single_file(c.denoiser.state_dict()) if k.endswith(".weight")]
    t5 = [k[:-len(".weight")] for k in c.text_encoders[0].state_dict() if k.endswith(".weight")]
    return ({f"lora_unet_{k.replace('.', '_')}" for k in dit} | {f"diffusion_model.{k}" for k in dit}
            | {f"lora_te1_{k.replace('.', '_')}" for k in t5} | {f"text_encoders.t5xxl.transformer.{k}" for k in t5})


def _used_by_comfy(state: dict, key_map: set[str]) -> tuple[set[str], set[str]]:
    """(used, unused) keys as ComfyUI's load_lora sorts them: `<name>.lora_up.weight` / `.lora_down.weight` /
    `.alpha` are used when `<name>` is in the key map."""
    used = {k for k in state if k.rpartition(".lora_")[0] in key_map or k.rpartition(".alpha")[0] in key_map}
    return used, set(state) - used


def test_chroma_t5_lora_to_comfy_uses_every_key(tmp_path):
    """A Chroma LoRA with train_t5xxl=True: our file (as sd-scripts') names T5 lora_te3_, which ComfyUI maps only
    beside CLIP-L (FLUX.1); for a T5-only model it maps lora_te1_. --to comfy renames exactly those 504 keys."""
    from tools import convert_lora

    family = get_family("chroma")
    c = family.load(LoadOptions("tiny:chroma"))
    net = create_network(1.0, 4, 2, c.vae, c.text_encoders, c.denoiser, lora_targets=family.lora_targets(c),
                         train_t5xxl="True")
    src, dst = str(tmp_path / "chroma.safetensors"), str(tmp_path / "chroma_comfy.safetensors")
    net.save_weights(src, None, {"ss_base_model_version": "chroma", "ss_network_module": "networks.lora_flux"})
    kohya = load_file(src)
    key_map = _comfy_chroma_key_map(c)
    t5_keys = {k for k in kohya if k.startswith("lora_te3_")}
    # 168 T5 modules (24 blocks x q, k, v, o, wi_0, wi_1, wo; the tiny T5 has T5-XXL's depth) x 3 keys
    assert len(t5_keys) == 504 and len(kohya) == 504 + 22 * 3
    assert _used_by_comfy(kohya, key_map)[1] == t5_keys  # the file as it is: every T5 key unused

    assert convert_lora.main(["--src_path", src, "--dst_path", dst, "--to", "comfy"]) == 0
    comfy = load_file(dst)
    expected = {("lora_te1_" + k[len("lora_te3_"):] if k in t5_keys else k) for k in kohya}
    assert set(comfy) == expected
    assert "lora_te1_encoder_block_23_layer_1_DenseReluDense_wi_0.lora_down.weight" in comfy
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight" in comfy  # the DiT keys as they were
    assert _used_by_comfy(comfy, key_map) == (set(comfy), set())
    name = "encoder_block_3_layer_0_SelfAttention_q.lora_up.weight"
    assert torch.equal(comfy["lora_te1_" + name], kohya["lora_te3_" + name])

    # and back: our tools read ComfyUI's lone-T5 name as ours
    assert set(convert(comfy, "kohya", dst)) == set(kohya)


def test_comfy_chroma_without_metadata_and_flux_refused(tmp_path):
    """Without metadata, a Flux-layout file with no modulation layers and T5 as its only encoder is Chroma's; a
    FLUX.1 file (CLIP-L, modulation layers) is refused by --to comfy, naming what the layout is for."""
    import pytest

    from networks.lora_files import UnsupportedLoraError

    family = get_family("chroma")
    c = family.load(LoadOptions("tiny:chroma"))
    net = create_network(1.0, 4, 2, c.vae, c.text_encoders, c.denoiser, lora_targets=family.lora_targets(c),
                         train_t5xxl="True")
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    assert sum(k.startswith("lora_te1_") for k in convert(state, "comfy", "chroma.safetensors")) == 504
    with pytest.raises(UnsupportedLoraError, match="flux.safetensors: the comfy layout is for Anima"):
        convert(state, "comfy", "flux.safetensors", {"ss_base_model_version": "flux1"})


def test_chroma_t5_lora_in_diffusers_is_left_out():
    """ChromaPipeline loads `transformer` and `text_encoder` (its T5), but diffusers 0.42's text-encoder LoRA loader
    maps only CLIP's module names (q_proj, ..., fc2) from PEFT to its own format: T5 keys named text_encoder.* make
    load_lora_weights fail. So --to diffusers keeps FLUX.1's text_encoder_2.* for the T5, which the pipeline skips
    while it loads every DiT key (docs/lora_format.md, the loader table)."""
    import pytest
    from diffusers import ChromaPipeline, FlowMatchEulerDiscreteScheduler
    from peft.tuners.lora import LoraLayer

    family = get_family("chroma")
    c = family.load(LoadOptions("tiny:chroma"))
    net = create_network(1.0, 4, 2, c.vae, c.text_encoders, c.denoiser, lora_targets=family.lora_targets(c),
                         train_t5xxl="True")
    kohya = {k: v.detach().clone() for k, v in net.state_dict().items()}
    peft = convert(kohya, "diffusers", "chroma.safetensors", {"ss_base_model_version": "chroma"})
    assert len([k for k in peft if k.startswith("text_encoder_2.encoder.block.")]) == 2 * 168

    def pipe():
        return ChromaPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=c.vae,
                              text_encoder=copy.deepcopy(c.text_encoders[0]), tokenizer=c.tokenizers[0],
                              transformer=copy.deepcopy(c.denoiser))

    p = pipe()
    p.load_lora_weights(peft)
    assert sum(isinstance(m, LoraLayer) for m in p.transformer.modules()) == 2 * 2 * 6 + 3 * 5  # every DiT key
    assert not any(isinstance(m, LoraLayer) for m in p.text_encoder.modules())
    as_text_encoder = {("text_encoder." + k[len("text_encoder_2."):] if k.startswith("text_encoder_2.") else k): v
                       for k, v in peft.items()}
    with pytest.raises(ValueError, match="Could not automatically infer state dict type"):
        pipe().load_lora_weights(as_text_encoder)
