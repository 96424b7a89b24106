"""The SDXL family: presets and both on-disk layouts, text conditioning, LoRA names and counts, diffusers round trip."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from library.families import get_family
from library.families.base import LoadOptions, ModelLoadError
from library.families.sdxl.configs import build_sdxl_modules
from library.families.sdxl.lora_names import convert_to_sgm_names, sgm_lora_name
from networks import lora
from networks.lora import iter_target_modules
from networks.lora_args import sdxl_unet_block_index


@pytest.fixture
def tiny(tiny_sdxl_modules):
    return tiny_sdxl_modules


@pytest.fixture
def layouts(tiny_sdxl_file, tiny_sdxl_folder):
    """tiny:sdxl written by write_sdxl_preset as one SGM file and as a diffusers folder."""
    return tiny_sdxl_file, tiny_sdxl_folder


def _components(parts):
    from library.families.base import Components

    return Components(denoiser=parts["unet"], vae=parts["vae"],
                      text_encoders=[parts["text_encoder"], parts["text_encoder_2"]],
                      tokenizers=[parts["tokenizer"], parts["tokenizer_2"]])


def _counts(family, components, conv=False, optional=False):
    """Modules per target: the trained ones (sd-scripts' counts), or with `optional` those only a file turns on."""
    return [sum(1 for _ in iter_target_modules(t, conv)) for t in family.lora_targets(components)
            if (t.enabled_by is not None) == optional]


def test_family_constants():
    family = get_family("sdxl")
    assert (family.name, family.latent_cache_arch, family.latents_scale, family.bucket_reso_multiple) == \
        ("sdxl", "_sdxl", 0.13025, 32)
    assert family.base_model_version(None) == "sdxl_base_v1-0"
    assert family.modelspec_architecture(None, 1024) == "stable-diffusion-xl-v1-base"
    assert family.modelspec_implementation() == "https://github.com/Stability-AI/generative-models"


def test_both_layouts_load_back_bitwise(layouts, tiny):
    from safetensors import safe_open

    single = layouts[0]
    with safe_open(single, "pt") as f:
        keys = set(f.keys())
    for key in ("model.diffusion_model.label_emb.0.0.weight", "model.diffusion_model.input_blocks.4.1.proj_in.weight",
                "model.diffusion_model.output_blocks.2.2.conv.weight", "model.diffusion_model.middle_block.1.proj_out.bias",
                "first_stage_model.decoder.up.3.upsample.conv.weight",
                "conditioner.embedders.0.transformer.text_model.encoder.layers.11.mlp.fc2.weight",
                "conditioner.embedders.1.model.transformer.resblocks.31.attn.in_proj_weight",
                "conditioner.embedders.1.model.text_projection", "conditioner.embedders.1.model.ln_final.weight"):
        assert key in keys, key
    family = get_family("sdxl")
    for path in layouts:
        c = family.load(LoadOptions(path))
        for ours, ref in ((c.denoiser, tiny["unet"]), (c.vae, tiny["vae"]), (c.text_encoders[0], tiny["text_encoder"]),
                          (c.text_encoders[1], tiny["text_encoder_2"])):
            a, b = ours.state_dict(), ref.state_dict()
            assert set(a) == set(b)
            assert all(torch.equal(a[k], b[k]) for k in a), path


def test_wrong_family_inputs_give_one_line_errors(tiny_sd1_file, layouts):
    sd1 = tiny_sd1_file
    with pytest.raises(ModelLoadError, match=r"SD 1\.x/2\.x checkpoint .*not SDXL; use train_network\.py") as e:
        get_family("sdxl").load(LoadOptions(sd1))
    assert "\n" not in str(e.value)
    with pytest.raises(ModelLoadError, match="tiny:sd1 is an SD 1.x/2.x preset, not SDXL"):
        get_family("sdxl").load(LoadOptions("tiny:sd1"))
    with pytest.raises(ModelLoadError, match="this is an SDXL checkpoint"):
        get_family("sd").load(LoadOptions(layouts[0]))


def test_lora_counts_full_size_on_meta_and_tiny(tiny):
    family = get_family("sdxl")
    full = _components(build_sdxl_modules("random:sdxl", device="meta"))
    assert _counts(family, full) == [722, 72, 192]
    assert _counts(family, full, conv=True) == [788, 72, 192]
    assert _counts(family, _components(tiny), conv=True) == [788, 72, 192]  # tiny keeps the topology
    # conv_in, conv_out, and time_embed + label_emb (2 Linears each), for files that have them
    assert _counts(family, full, conv=True, optional=True) == [1, 1, 4]


def test_lora_key_names_are_sgm(tiny):
    family = get_family("sdxl")
    names = {name for t in family.lora_targets(_components(tiny)) for name, _ in iter_target_modules(t, True)}
    for name in ("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q",
                 "lora_unet_input_blocks_8_1_transformer_blocks_9_ff_net_2",
                 "lora_unet_middle_block_1_transformer_blocks_9_attn2_to_out_0", "lora_unet_middle_block_1_proj_in",
                 "lora_unet_output_blocks_0_1_transformer_blocks_9_attn2_to_k", "lora_unet_output_blocks_5_1_proj_out",
                 "lora_unet_input_blocks_1_0_in_layers_2", "lora_unet_input_blocks_3_0_op",
                 "lora_unet_output_blocks_2_2_conv", "lora_unet_output_blocks_8_0_skip_connection",
                 "lora_unet_middle_block_2_emb_layers_1",
                 "lora_te1_text_model_encoder_layers_11_self_attn_q_proj",
                 "lora_te2_text_model_encoder_layers_31_mlp_fc2"):
        assert name in names, name
    assert not [n for n in names if "down_blocks" in n or "up_blocks" in n or "mid_block_" in n]


def test_diffusers_names_convert_to_sgm_and_block_index():
    assert sgm_lora_name("lora_unet_down_blocks_2_attentions_1_transformer_blocks_3_attn2_to_v") == \
        "lora_unet_input_blocks_8_1_transformer_blocks_3_attn2_to_v"
    assert sgm_lora_name("lora_unet_up_blocks_1_upsamplers_0_conv") == "lora_unet_output_blocks_5_2_conv"
    assert sgm_lora_name("lora_unet_mid_block_resnets_1_time_emb_proj") == "lora_unet_middle_block_2_emb_layers_1"
    assert sgm_lora_name("lora_te2_text_model_encoder_layers_0_mlp_fc1") == "lora_te2_text_model_encoder_layers_0_mlp_fc1"
    down, up = torch.zeros(4, 32), torch.zeros(64, 4)
    peft = {"unet.down_blocks.1.attentions.0.proj_in.lora_A.weight": down,
            "unet.down_blocks.1.attentions.0.proj_in.lora_B.weight": up,
            "text_encoder_2.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": down}
    assert sorted(convert_to_sgm_names(peft)) == [
        "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.alpha",
        "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight",
        "lora_unet_input_blocks_4_1_proj_in.alpha", "lora_unet_input_blocks_4_1_proj_in.lora_down.weight",
        "lora_unet_input_blocks_4_1_proj_in.lora_up.weight"]
    assert [sdxl_unet_block_index(n) for n in (
        "lora_unet_input_blocks_1_0_in_layers_2", "lora_unet_input_blocks_8_1_proj_in", "lora_unet_middle_block_0_x",
        "lora_unet_middle_block_2_x", "lora_unet_output_blocks_0_1_x", "lora_unet_output_blocks_8_0_x",
        "lora_te1_text_model_encoder_layers_0_mlp_fc1")] == [2, 9, 10, 12, 13, 21, -1]


def test_encode_text_penultimate_states_pool_and_chunks(tiny):
    family = get_family("sdxl")
    c = _components(tiny)
    captions = ["a photo of a cat", "a dog " * 60]
    tokens = family.tokenize(c, captions, None)
    assert [tuple(t.shape) for t in tokens] == [(2, 77), (2, 77)]
    assert tokens[1][0, -1].item() == tiny["tokenizer_2"].pad_token_id  # encoder 2 pads with "!"
    with torch.no_grad():
        text = family.encode_text(c, tokens, None).tensors
        assert {k: tuple(v.shape) for k, v in text.items()} == \
            {"hidden_state1": (2, 77, 32), "hidden_state2": (2, 77, 64), "pool2": (2, 64)}
        ref1 = tiny["text_encoder"](tokens[0], output_hidden_states=True).hidden_states[11]
        out2 = tiny["text_encoder_2"](tokens[1], output_hidden_states=True)
        assert torch.equal(text["hidden_state1"], ref1)
        assert torch.equal(text["hidden_state2"], out2.hidden_states[31])
        assert torch.equal(text["pool2"], out2.text_embeds)
        long = family.encode_text(c, family.tokenize(c, captions, 150), None).tensors
    assert {k: tuple(v.shape) for k, v in long.items()} == \
        {"hidden_state1": (2, 152, 32), "hidden_state2": (2, 152, 64), "pool2": (2, 64)}
    assert torch.allclose(long["pool2"][0], text["pool2"][0], atol=1e-5)  # pool of the first chunk


def test_predict_passes_size_ids_and_pool(tiny):
    from library.families.base import TextConditioning
    from library.families.sdxl.family import time_ids

    batch = {"original_sizes_hw": torch.tensor([[1080, 1920]]), "crop_top_lefts": torch.tensor([[0, 24]]),
             "target_sizes_hw": torch.tensor([[768, 1344]])}
    assert time_ids(batch, torch.device("cpu"), torch.float32).tolist() == [[1080, 1920, 0, 24, 768, 1344]]
    family, c = get_family("sdxl"), _components(tiny)
    g = torch.Generator().manual_seed(0)
    text = TextConditioning({"hidden_state1": torch.randn(1, 77, 32, generator=g),
                             "hidden_state2": torch.randn(1, 77, 64, generator=g),
                             "pool2": torch.randn(1, 64, generator=g)})
    x = torch.randn(1, 4, 8, 8, generator=g)
    with torch.no_grad():
        pred = family.predict(c, x, torch.tensor([500]), text, batch)
        other = dict(batch, crop_top_lefts=torch.tensor([[0, 0]]))
        moved = family.predict(c, x, torch.tensor([500]), text, other)
        ref = tiny["unet"](x, torch.tensor([500]), torch.cat([text.tensors["hidden_state1"], text.tensors["hidden_state2"]], 2),
                           added_cond_kwargs={"text_embeds": text.tensors["pool2"],
                                              "time_ids": torch.tensor([[1080., 1920, 0, 24, 768, 1344]])}).sample
    assert torch.equal(pred, ref)
    assert not torch.allclose(pred, moved)  # the crop ids reach the UNet


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_saved_lora_loads_in_diffusers_sdxl_pipeline(tmp_path, tiny):
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline
    from peft.tuners.lora import LoraLayer

    ours, theirs, merged = copy.deepcopy(tiny), copy.deepcopy(tiny), copy.deepcopy(tiny)
    family = get_family("sdxl")
    tes = [ours["text_encoder"], ours["text_encoder_2"]]
    net = lora.create_network(1.0, 4, 2, None, tes, ours["unet"], lora_targets=family.lora_targets(_components(ours)))
    g = torch.Generator().manual_seed(0)
    for m in net.unet_loras + net.text_encoder_loras:
        m.lora_up.weight.data = torch.randn(m.lora_up.weight.shape, generator=g) * 0.05
    path = str(tmp_path / "sdxl_lora.safetensors")
    net.save_weights(path, torch.float32, {"ss_network_module": "networks.lora"})

    pipe = StableDiffusionXLPipeline(vae=theirs["vae"], text_encoder=theirs["text_encoder"],
                                     text_encoder_2=theirs["text_encoder_2"], tokenizer=theirs["tokenizer"],
                                     tokenizer_2=theirs["tokenizer_2"], unet=theirs["unet"],
                                     scheduler=EulerDiscreteScheduler())
    records = _Records()
    logging.getLogger("diffusers").addHandler(records)
    try:
        pipe.load_lora_weights(path, adapter_name="ours")
    finally:
        logging.getLogger("diffusers").removeHandler(records)
    assert not [m for m in records.messages if "unexpected" in m.lower() or "missing" in m.lower()]
    counts = [sum(isinstance(m, LoraLayer) for m in model.modules())
              for model in (pipe.unet, pipe.text_encoder, pipe.text_encoder_2)]
    assert counts == [722, 72, 192]

    ids = family.tokenize(_components(tiny), ["a photo of a cat"], None)
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    batch = {"original_sizes_hw": torch.tensor([[64, 64]]), "crop_top_lefts": torch.tensor([[0, 0]]),
             "target_sizes_hw": torch.tensor([[64, 64]])}

    def run(parts):
        c = _components(parts)
        with torch.no_grad():
            text = family.encode_text(c, ids, None)
            return text.tensors["pool2"], family.predict(c, x, torch.tensor([500]), text, batch)

    base_pool, base_pred = run(merged)
    net.apply_to(tes, ours["unet"])
    our_pool, our_pred = run(ours)
    their_pool, their_pred = run(theirs)
    merger, weights = lora.create_network_from_weights(
        1.0, path, None, [merged["text_encoder"], merged["text_encoder_2"]], merged["unet"],
        lora_targets=family.lora_targets(_components(merged)))
    merger.merge_to(None, None, weights, torch.float32, "cpu")
    merged_pool, merged_pred = run(merged)

    def close(a, b):
        return torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))

    assert not close(our_pred, base_pred)
    assert close(their_pool, our_pool) and close(their_pred, our_pred)
    assert close(merged_pool, our_pool) and close(merged_pred, our_pred)


@pytest.mark.parametrize("name", ["merged.safetensors", "merged_folder"])
def test_save_checkpoint_round_trip(tmp_path, name, tiny_sdxl_copy):
    """SDXLFamily.save_checkpoint (used by merge_lora) writes what SDXLFamily.load reads back exactly."""
    family = get_family("sdxl")
    comps = tiny_sdxl_copy  # changed below
    with torch.no_grad():
        next(comps.denoiser.parameters()).add_(1.0)  # as a merge would change it
    path = str(tmp_path / name)
    family.save_checkpoint(comps, path)
    back = family.load(LoadOptions(path))
    for a, b in ((comps.denoiser, back.denoiser), (comps.text_encoders[1], back.text_encoders[1])):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
