"""SD 1.x / 2.x family: registry, presets, topology counts, text chunking, clip_skip, metadata."""

import pytest
import torch
from torch import nn

from library.core.errors import ConfigError
from library.families import family_names, get_family
from library.families.base import TextConditioning
from library.families.common.clip_text import final_layer_norm
from library.families.sd.family import SDFamily
from library.families.common.tiny import tiny_vocab_size
from library.families.sd.configs import build_sd_modules
from tests.train_helpers import assert_close_measured


@pytest.fixture(scope="module")
def family():
    return get_family("sd")


@pytest.fixture
def sd1(tiny_sd1):
    return tiny_sd1


@pytest.fixture
def sd2(tiny_sd2):
    return tiny_sd2


def kohya_modules(target, conv: bool) -> list[str]:
    """kohya names of the Linear/Conv2d modules a LoRA would wrap (as networks/lora.py does)."""
    classes = target.target_classes + (target.conv_target_classes if conv else ())
    names = []
    for path, module in target.root.named_modules():
        if type(module).__name__ not in classes:
            continue
        for child_path, child in module.named_modules():
            if isinstance(child, (nn.Linear, nn.Conv2d)) and child_path:
                full = f"{path}.{child_path}" if path else child_path
                full = target.rename(full) if target.rename else full
                names.append(target.prefix + "_" + full.replace(".", "_"))
    return names


def test_registry():
    assert {"sd", "sdxl"} <= set(family_names()) and family_names() == sorted(family_names())
    assert isinstance(get_family("sd"), SDFamily)
    with pytest.raises(ConfigError, match=f"model family: expected one of {', '.join(family_names())}, got 'sd4'"):
        get_family("sd4")


def test_tiny_preset_is_deterministic_and_keeps_global_rng():
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = build_sd_modules("tiny:sd1")
    after = torch.rand(3)
    b = build_sd_modules("tiny:sd1")
    assert torch.equal(after, expected_next)  # building did not consume the caller's RNG
    for part in ("unet", "vae", "text_encoder"):
        sa, sb = a[part].state_dict(), b[part].state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    # A weight fixed by the seed (golden): changes here mean every saved tiny model changes.
    assert a["unet"].conv_in.weight.shape == (32, 4, 3, 3)
    assert a["text_encoder"].config.vocab_size == tiny_vocab_size() == 987


def test_tiny_topology_matches_real(sd1, sd2):
    unet = sd1.denoiser
    assert [type(b).__name__ for b in unet.down_blocks] == [
        "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"]
    assert unet.config.block_out_channels == (32, 64, 128, 128)
    assert len(sd1.text_encoders[0].encoder.layers) == 12
    assert len(sd2.text_encoders[0].encoder.layers) == 23
    assert sd2.denoiser.config.use_linear_projection is True
    assert isinstance(sd2.denoiser.down_blocks[0].attentions[0].proj_in, nn.Linear)
    assert isinstance(sd1.denoiser.down_blocks[0].attentions[0].proj_in, nn.Conv2d)
    # The VAE still maps 64x64 images to 4x8x8 latents.
    latents = SDFamily().encode_images(sd1.vae, torch.zeros(1, 3, 64, 64))
    assert latents.shape == (1, 4, 8, 8)


@pytest.mark.parametrize("preset,tiny", [("random:sd15", "tiny:sd1"), ("random:sd21", "tiny:sd2")])
def test_lora_module_counts_full_size_equal_tiny(family, preset, tiny, request):
    from library.families.base import Components

    counts = {}
    for name in (preset, tiny):
        if name == preset:
            parts = build_sd_modules(name, device="meta")
            comps = Components(parts["unet"], parts["vae"], [parts["text_encoder"]], [parts["tokenizer"]])
        else:  # the session's tiny:sd1 / tiny:sd2
            comps = request.getfixturevalue("tiny_" + name.split(":")[1])
        unet_t, te_t = [t for t in family.lora_targets(comps) if t.enabled_by is None]  # the trained targets
        counts[name] = (kohya_modules(unet_t, False), kohya_modules(unet_t, True), kohya_modules(te_t, False))
    full, small = counts[preset], counts[tiny]
    assert [len(x) for x in full] == ([192, 278, 72] if preset == "random:sd15" else [192, 278, 138])
    assert full == small  # same kohya names, same order
    assert full[0][:2] == ["lora_unet_down_blocks_0_attentions_0_proj_in",
                          "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"]
    assert full[2][0] == "lora_te_text_model_encoder_layers_0_self_attn_k_proj"
    assert "lora_te_text_model_encoder_layers_0_mlp_fc2" in full[2]
    assert "lora_unet_up_blocks_0_upsamplers_0_conv" in full[1]


def test_full_size_parameter_counts_on_meta():
    sd15 = build_sd_modules("random:sd15", device="meta")
    sd21 = build_sd_modules("random:sd21", device="meta")
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n(sd15["unet"]) == 859_520_964  # the published SD 1.5 UNet size
    assert n(sd15["text_encoder"]) == 123_060_480  # CLIP ViT-L/14 text tower
    assert n(sd15["vae"]) == 83_653_863
    assert n(sd21["unet"]) == 865_910_724
    assert sd15["unet"].device.type == "meta"


def test_tokenize_shapes_and_padding(family, sd1, sd2):
    captions = ["a photo of a cat", "a dog"]
    tok1 = sd1.tokenizers[0]
    bos, eos = tok1.bos_token_id, tok1.eos_token_id
    for max_len, width in ((None, 77), (75, 77), (150, 154), (225, 231)):
        assert family.tokenize(sd1, captions, max_len)[0].shape == (2, width)
    ids = family.tokenize(sd1, ["a cat"], 150)[0][0]
    cat = tok1("a cat").input_ids[1:-1]
    # SD1: chunk 1 = BOS a cat EOS EOS...; chunk 2 = BOS then EOS padding.
    assert ids[:77].tolist() == [bos] + cat + [eos] * (76 - len(cat))
    assert ids[77:].tolist() == [bos] + [eos] * 76
    # SD2 pads with "!" (id 0); an empty second chunk starts BOS EOS then pads.
    ids2 = family.tokenize(sd2, ["a cat"], 150)[0][0]
    assert ids2[:77].tolist() == [bos] + cat + [eos] + [0] * (75 - len(cat))
    assert ids2[77:].tolist() == [bos, eos] + [0] * 75
    # SD2: a chunk cut mid-text ends with EOS.
    long_ids = family.tokenize(sd2, ["cat " * 100], 150)[0][0]
    assert long_ids[76].item() == eos and long_ids[153].item() == eos
    with pytest.raises(ConfigError, match="--max_token_length: expected 75, 150 or 225"):
        family.tokenize(sd1, captions, 100)


@torch.no_grad()
def test_encode_text_chunks(family, sd1):
    te = sd1.text_encoders[0]
    captions = ["a photo of a cat with long hair", "masterpiece"]
    tokens = family.tokenize(sd1, captions, None)
    out = family.encode_text(sd1, tokens, None)
    assert isinstance(out, TextConditioning) and list(out.tensors) == ["encoder_hidden_states"]
    assert torch.equal(out.tensors["encoder_hidden_states"], te(tokens[0])[0])
    for max_len, length in ((150, 152), (225, 227)):
        tokens = family.tokenize(sd1, captions, max_len)
        states = family.encode_text(sd1, tokens, None).tensors["encoder_hidden_states"]
        assert states.shape == (2, length, 32)
        per_chunk = [te(c)[0] for c in tokens[0].split(77, dim=1)]
        expected = torch.cat([per_chunk[0][:, :1]] + [c[:, 1:76] for c in per_chunk] + [per_chunk[-1][:, -1:]], 1)
        # the family encodes every chunk in one batch, here chunk by chunk: other matrix shapes, whose kernels
        # may sum in another order. Measured 0 with the AVX-512, AVX2 and default kernels (ATEN_CPU_CAPABILITY);
        # the states are ~1 (layer norm). Chunks in the wrong order give 2.5
        assert_close_measured(states, expected, 1e-5, f"{max_len} tokens: chunks in one batch vs one by one")


@torch.no_grad()
def test_clip_skip_two_is_penultimate_through_final_norm(family, sd1, sd2):
    for comps in (sd1, sd2):
        te = comps.text_encoders[0]
        tokens = family.tokenize(comps, ["a red car"], None)
        states = family.encode_text(comps, tokens, 2).tensors["encoder_hidden_states"]
        hidden = te(tokens[0], output_hidden_states=True).hidden_states
        assert torch.equal(states, final_layer_norm(te)(hidden[-2]))
        assert not torch.equal(states, te(tokens[0])[0])
        one = family.encode_text(comps, tokens, 1).tensors["encoder_hidden_states"]
        assert torch.equal(one, te(tokens[0])[0])


@torch.no_grad()
def test_predict_calls_unet(family, sd1):
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([500])
    text = family.encode_text(sd1, family.tokenize(sd1, ["a cat"], None), None)
    out = family.predict(sd1, latents, t, text, {})
    assert out.shape == (1, 4, 8, 8)
    assert torch.equal(out, sd1.denoiser(latents, t, text.tensors["encoder_hidden_states"]).sample)


def test_lora_targets_and_metadata(family, sd1, sd2, tiny_sd2v):
    sd2v = tiny_sd2v
    unet_t, te_t, *optional = family.lora_targets(sd1)
    assert all(t.enabled_by is not None for t in optional)  # conv_in, conv_out, time_embedding: from files only
    assert (unet_t.prefix, unet_t.target_classes, unet_t.conv_target_classes) == (
        "lora_unet", ("Transformer2DModel",), ("ResnetBlock2D", "Downsample2D", "Upsample2D"))
    assert te_t.prefix == "lora_te" and te_t.is_text_encoder and "CLIPAttention" in te_t.target_classes
    assert te_t.rename("encoder.layers.0.mlp") == "text_model.encoder.layers.0.mlp"
    assert [family.base_model_version(c) for c in (sd1, sd2, sd2v)] == ["sd_v1", "sd_v2", "sd_v2_v"]
    assert [family.modelspec_architecture(c, 512) for c in (sd1, sd2, sd2v)] == [
        "stable-diffusion-v1", "stable-diffusion-v2-512", "stable-diffusion-v2-768-v"]
    assert (sd1.v2, sd2.v2, sd2v.v2, sd2v.v_parameterization, sd2.v_parameterization) == (
        False, True, True, True, False)


def test_noise_scheme_prediction_type(family, sd1, tiny_sd2v):
    noise = pytest.importorskip("library.objectives.noise")
    sd2v = tiny_sd2v
    eps, v = family.noise_scheme(sd1), family.noise_scheme(sd2v, zero_terminal_snr=True)
    assert isinstance(eps, noise.DDPMScheme)
    assert eps.prediction_type == "epsilon" and v.prediction_type == "v_prediction"
