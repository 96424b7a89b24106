"""Key conversion kohya <-> diffusers/PEFT <-> ai-toolkit: golden key names, exact round trips, diffusers parity."""

import re

import pytest
import torch

from library.families.lora_convert import convert, detect_layout, to_diffusers, to_kohya
from networks.lora_files import UnsupportedLoraError, group_modules

H = 3072  # Flux hidden size: diffusers' converter hard-codes the single-block split dims


def _kohya(name, out, inn, rank, alpha, seed, kernel=None):
    g = torch.Generator().manual_seed(seed)
    down = torch.randn(rank, inn, *(kernel or ()), generator=g)
    up = torch.randn(out, rank, *((1, 1) if kernel else ()), generator=g)
    return {f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up, f"{name}.alpha": torch.tensor(float(alpha))}


def _flux_lora():
    sd = {}
    for i, (short, out, inn) in enumerate([("img_attn_qkv", 3 * H, H), ("img_attn_proj", H, H), ("txt_mlp_0", 4 * H, H),
                                           ("txt_attn_qkv", 3 * H, H), ("img_mod_lin", 6 * H, H)]):
        sd.update(_kohya(f"lora_unet_double_blocks_0_{short}", out, inn, 4, 2.0, i))
    sd.update(_kohya("lora_unet_single_blocks_7_linear1", 7 * H, H, 4, 1.0, 10))
    sd.update(_kohya("lora_unet_single_blocks_7_linear2", H, 5 * H, 4, 8.0, 11))
    # a split_qkv file: 3·2 ranks, block-diagonal up
    down, up = torch.randn(6, H), torch.zeros(3 * H, 6)
    for j in range(3):
        up[j * H:(j + 1) * H, 2 * j:2 * j + 2] = torch.randn(H, 2)
    sd.update({"lora_unet_double_blocks_1_img_attn_qkv.lora_down.weight": down,
               "lora_unet_double_blocks_1_img_attn_qkv.lora_up.weight": up,
               "lora_unet_double_blocks_1_img_attn_qkv.alpha": torch.tensor(3.0)})
    return sd


def _max_delta_error(a, b):
    """Largest relative difference of ΔW·x over the modules, x a random probe (cheaper than forming ΔW)."""
    ma, mb = group_modules(a, "a"), group_modules(b, "b")
    assert sorted(ma) == sorted(mb)
    worst = 0.0
    for k, m in ma.items():
        x = torch.randn(m.in_flat, 8, generator=torch.Generator().manual_seed(0))
        ya, yb = [(u @ (d @ x)) * mod.scale for mod in (m, mb[k]) for u, d in [mod.factors()]]
        worst = max(worst, float((ya - yb).norm() / ya.norm()))
    return worst


def test_flux_to_diffusers_matches_diffusers_converter():
    from diffusers.loaders.lora_conversion_utils import (
        _convert_kohya_flux_lora_to_diffusers,
    )

    sd = _flux_lora()
    ours = to_diffusers(sd, "flux.safetensors")
    theirs = _convert_kohya_flux_lora_to_diffusers({k: v.clone() for k, v in sd.items()})
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert ours["transformer.transformer_blocks.1.attn.to_k.lora_A.weight"].shape == (2, H)  # sparse qkv: rank 2 each
    assert ours["transformer.single_transformer_blocks.7.proj_mlp.lora_B.weight"].shape == (4 * H, 4)


def test_flux_round_trip_is_exact():
    sd = _flux_lora()
    for layout in ("diffusers", "ai-toolkit"):
        back = convert(convert(sd, layout, "in"), "kohya", "out")
        assert sorted(back) == sorted(sd)
        assert all(back[k].shape == sd[k].shape for k in sd)
        assert _max_delta_error(sd, back) < 1e-6


SD1_NAMES = {
    "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q":
        "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q",
    "lora_unet_up_blocks_3_attentions_2_transformer_blocks_0_ff_net_0_proj":
        "unet.up_blocks.3.attentions.2.transformer_blocks.0.ff.net.0.proj",
    "lora_unet_mid_block_attentions_0_proj_in": "unet.mid_block.attentions.0.proj_in",
    "lora_unet_up_blocks_1_resnets_2_time_emb_proj": "unet.up_blocks.1.resnets.2.time_emb_proj",
    "lora_te_text_model_encoder_layers_11_self_attn_out_proj": "text_encoder.text_model.encoder.layers.11.self_attn.out_proj",
}


def _sd1_lora(alpha):
    sd = {}
    for i, name in enumerate(SD1_NAMES):
        sd.update(_kohya(name, 32, 16, 4, alpha, i, kernel=(1, 1) if name.endswith("proj_in") else None))
    sd.update(_kohya("lora_unet_down_blocks_1_resnets_0_conv1", 32, 16, 4, alpha, 9, kernel=(3, 3)))
    return sd


def test_sd1_diffusers_key_names_and_exact_round_trip():
    sd = _sd1_lora(alpha=4.0)  # alpha = rank: scale 1, so the round trip is bit-exact
    peft = to_diffusers(sd, "sd1")
    assert sorted(k[:-len(".lora_A.weight")] for k in peft if k.endswith("lora_A.weight")) == sorted(
        list(SD1_NAMES.values()) + ["unet.down_blocks.1.resnets.0.conv1"])
    assert detect_layout(peft, "p") == "diffusers"
    back = to_kohya(peft, "p")
    assert sorted(back) == sorted(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_alpha_is_baked_into_the_weights():
    sd = _sd1_lora(alpha=1.0)  # scale 1/4: diffusers' rule gives A·0.5 and B·0.5
    peft = to_diffusers(sd, "sd1")
    name = "lora_unet_mid_block_attentions_0_proj_in"
    assert torch.equal(peft["unet.mid_block.attentions.0.proj_in.lora_A.weight"], sd[f"{name}.lora_down.weight"] * 0.5)
    back = to_kohya(peft, "p")
    assert float(back[f"{name}.alpha"]) == 4.0  # rank: the scale now lives in the weights
    assert _max_delta_error(sd, back) < 1e-6


def test_sdxl_sgm_names_map_to_diffusers_and_back():
    sd = {}
    for i, name in enumerate(["lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q",
                              "lora_unet_middle_block_1_proj_out", "lora_unet_output_blocks_2_2_conv",
                              "lora_unet_input_blocks_7_0_emb_layers_1",
                              "lora_te1_text_model_encoder_layers_0_mlp_fc1",
                              "lora_te2_text_model_encoder_layers_31_self_attn_k_proj"]):
        sd.update(_kohya(name, 32, 16, 4, 4.0, i))
    peft = to_diffusers(sd, "sdxl")
    assert sorted(k[:-len(".lora_A.weight")] for k in peft if k.endswith("lora_A.weight")) == [
        "text_encoder.text_model.encoder.layers.0.mlp.fc1",
        "text_encoder_2.text_model.encoder.layers.31.self_attn.k_proj",
        "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
        "unet.down_blocks.2.resnets.0.time_emb_proj",
        "unet.mid_block.attentions.0.proj_out",
        "unet.up_blocks.0.upsamplers.0.conv",
    ]
    back = to_kohya(peft, "p")
    assert sorted(back) == sorted(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_unknown_and_lycoris_files_are_refused_with_the_key():
    with pytest.raises(UnsupportedLoraError, match=r"x.safetensors: unexpected key 'model.diffusion_model.w'"):
        detect_layout({"model.diffusion_model.w": torch.zeros(1)}, "x.safetensors")
    with pytest.raises(UnsupportedLoraError, match=r"lora_unet_a.hada_w1_a: a LyCORIS LoHa module"):
        detect_layout({"lora_unet_a.hada_w1_a": torch.zeros(1)}, "loha.safetensors")
    with pytest.raises(UnsupportedLoraError, match=r"ai-toolkit layout is for Flux LoRAs"):
        convert(_sd1_lora(4.0), "ai-toolkit", "sd1.safetensors")
    bad = dict(_sd1_lora(4.0))
    bad["lora_unet_x.lora_mystery.weight"] = torch.zeros(1)
    with pytest.raises(UnsupportedLoraError, match=r"unexpected key 'lora_unet_x.lora_mystery.weight'"):
        group_modules(bad, "bad.safetensors")


def _full_size_flux_kohya(rank=2):
    """Every module of a real FLUX.1 LoRA (19 double + 38 single blocks, fused qkv / linear1), rank `rank`."""
    from library.families.flux.lora_names import DOUBLE_BLOCK, SINGLE_BLOCK

    shapes = {"img_mod.lin": (6 * H, H), "txt_mod.lin": (6 * H, H), "img_attn.qkv": (3 * H, H),
              "txt_attn.qkv": (3 * H, H), "img_attn.proj": (H, H), "txt_attn.proj": (H, H),
              "img_mlp.0": (4 * H, H), "img_mlp.2": (H, 4 * H), "txt_mlp.0": (4 * H, H), "txt_mlp.2": (H, 4 * H),
              "linear1": (7 * H, H), "linear2": (H, 5 * H), "modulation.lin": (3 * H, H)}
    sd, seed = {}, 0
    for kind, count, table in (("double_blocks", 19, DOUBLE_BLOCK), ("single_blocks", 38, SINGLE_BLOCK)):
        for i in range(count):
            for bfl in sorted({name for name, _ in table.values()}):
                out, inn = shapes[bfl]
                sd.update(_kohya(f"lora_unet_{kind}_{i}_{bfl.replace('.', '_')}", out, inn, rank, 1.0, seed))
                seed += 1
    return sd


def test_convert_full_size_flux_lora_to_diffusers_saves(tmp_path):
    """A real-size FLUX.1 LoRA (fused qkv split into q/k/v sharing one lora_A) converts to the
    diffusers layout and is written: no 'Some tensors share memory' from safetensors."""
    from safetensors.torch import load_file, save_file

    from tools import convert_lora

    sd = _full_size_flux_kohya()
    assert len(sd) == 3 * (19 * 10 + 38 * 3)
    src, dst = tmp_path / "flux_kohya.safetensors", tmp_path / "flux_peft.safetensors"
    save_file(sd, str(src))
    assert convert_lora.main(["--src_path", str(src), "--dst_path", str(dst), "--to", "diffusers"]) == 0
    out = load_file(str(dst))
    assert "transformer.transformer_blocks.18.attn.to_q.lora_A.weight" in out
    assert "transformer.single_transformer_blocks.37.proj_mlp.lora_B.weight" in out
    assert len(out) == 2 * 19 * (14) + 2 * 38 * 6
    back = to_kohya(out, "peft")
    assert _max_delta_error(sd, back) < 1e-5


def test_lumina_to_comfy_gives_gemma2_the_names_comfyuis_key_map_uses(tmp_path):
    """ComfyUI (a125cd84, comfy/lora.py) reads a Lumina LoRA's DiT by its kohya names but has none for Gemma-2: it
    maps a text-encoder weight by kohya name only for CLIP, T5 and HunyuanDiT's BERT, and every one by its generic
    name `text_encoders.<state-dict key>`; Lumina's encoder is `gemma2_2b.transformer.model.` + transformers' Gemma-2
    names (comfy/text_encoders/lumina2.py, llama.py). --to comfy renames exactly the Gemma-2 keys; they read back."""
    from safetensors.torch import load_file

    from library.families import get_family
    from library.families.base import LoadOptions
    from library.families.lora_convert import load_lora_file
    from networks.lora import create_network
    from tools import convert_lora

    family = get_family("lumina")
    c = family.load(LoadOptions("tiny:lumina"))
    net = create_network(1.0, 4, 2, c.vae, c.text_encoders, c.denoiser, lora_targets=family.lora_targets(c))
    src, dst = str(tmp_path / "lumina.safetensors"), str(tmp_path / "lumina_comfy.safetensors")
    net.save_weights(src, None, {"ss_base_model_version": "lumina2", "ss_network_module": "networks.lora_lumina"})
    kohya = load_file(src)
    # the key map, as data: the DiT's weights (NextDiT's own names, as ComfyUI's model holds them under
    # diffusion_model.) as lora_unet_<key with . -> _> and diffusion_model.<key>; Gemma-2's by the generic name
    dit = [k[:-len(".weight")] for k in family.single_file_state_dict(c) if k.endswith(".weight")]
    gemma = [k[:-len(".weight")] for k in c.text_encoders[0].state_dict() if k.endswith(".weight")]
    key_map = ({f"lora_unet_{k.replace('.', '_')}" for k in dit} | {f"diffusion_model.{k}" for k in dit}
               | {f"text_encoders.gemma2_2b.transformer.model.{k}" for k in gemma})

    def unused(state):
        return {k for k in state if k.rpartition(".lora_")[0] not in key_map and k.rpartition(".alpha")[0] not in key_map}

    te_keys = {k for k in kohya if k.startswith("lora_te_")}
    assert len(te_keys) == 546 and unused(kohya) == te_keys  # 26 layers x 7 modules x 3 keys: all unused as is

    assert convert_lora.main(["--src_path", src, "--dst_path", dst, "--to", "comfy"]) == 0
    comfy = load_file(dst)
    gemma_name = re.compile(r"^lora_te_layers_(\d+)_(self_attn|mlp)_([a-z]+_proj)\.(lora_down\.weight|lora_up\.weight|alpha)$")
    assert all(gemma_name.match(k) for k in te_keys)
    renamed = {k: "text_encoders.gemma2_2b.transformer.model.layers.{}.{}.{}.{}".format(*gemma_name.match(k).groups())
               for k in te_keys}
    assert "text_encoders.gemma2_2b.transformer.model.layers.0.self_attn.q_proj.lora_down.weight" in comfy
    assert "text_encoders.gemma2_2b.transformer.model.layers.25.mlp.gate_proj.alpha" in comfy
    assert set(comfy) == (set(kohya) - te_keys) | {renamed[k] for k in te_keys}
    assert not [k for k in comfy if "qwen3" in k]  # not taken for an Anima file (same Qwen3 / Gemma-2 names)
    assert unused(comfy) == set()
    name = "layers.3.self_attn.k_proj.lora_up.weight"
    assert torch.equal(comfy["text_encoders.gemma2_2b.transformer.model." + name],
                       kohya["lora_te_" + name.replace(".lora_up.weight", "").replace(".", "_") + ".lora_up.weight"])

    assert convert(comfy, "kohya", dst).keys() == kohya.keys()  # and back, and readable by every tool
    assert len(load_lora_file(dst).modules) == len(kohya) // 3


def test_an_sd1_peft_file_with_cross_attention_reads_back_as_sd1(tiny_sd1, tmp_path):
    """`.attn2.` marks SD3.5 only inside `transformer.`; an SD 1.x UNet's cross-attention used to send the whole
    file to the SD3 reader ("not an SD3 part")."""
    from library.families import get_family
    from library.families.lora_convert import convert, load_lora_file
    from safetensors.torch import load_file, save_file

    from tests.train_helpers import random_lora_file

    src = random_lora_file(get_family("sd"), tiny_sd1, str(tmp_path / "sd1.safetensors"))
    kohya = load_lora_file(src)
    peft = convert(load_file(src), "diffusers", src)
    assert any(".attn2." in k and k.startswith("unet.") for k in peft)
    save_file(peft, str(tmp_path / "peft.safetensors"))
    back = load_lora_file(str(tmp_path / "peft.safetensors")).modules
    assert back.keys() == kohya.modules.keys()
    for name, m in kohya.modules.items():
        torch.testing.assert_close(back[name].delta(), m.delta(), rtol=1e-5, atol=1e-7)
