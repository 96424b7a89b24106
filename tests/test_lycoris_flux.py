"""--network_module lycoris.kohya on FLUX.1: every algorithm wraps the diffusers blocks, saves, and reloads in LyCORIS."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from library.core.errors import ConfigError
from library.families import get_family
from library.families.base import LoadOptions
from library.train.adapters.network_kinds import network_kind
from library.train.adapters.network_setup import (
    external_state_dict,
    kohya_name_map,
    load_network_weights,
    preset_with_aliases,
)
from library.train.settings import NetworkOptions
from tests.train_helpers import base_args, make_dataset, make_trainer

lycoris_kohya = pytest.importorskip("lycoris.kohya")

# Per double block: both AdaLN modulations, q/k/v/out of the image and the text stream, both MLPs.
DOUBLE_0 = ["attn_add_k_proj", "attn_add_q_proj", "attn_add_v_proj", "attn_to_add_out", "attn_to_k", "attn_to_out_0",
            "attn_to_q", "attn_to_v", "ff_context_net_0_proj", "ff_context_net_2", "ff_net_0_proj", "ff_net_2",
            "norm1_context_linear", "norm1_linear"]
SINGLE_0 = ["attn_to_k", "attn_to_q", "attn_to_v", "norm_linear", "proj_mlp", "proj_out"]
# LyCORIS' presets list diffusers' TimestepEmbedding (for another model): Flux's time and guidance embedders.
EMBEDDERS = ["time_text_embed_guidance_embedder_linear_1", "time_text_embed_guidance_embedder_linear_2",
             "time_text_embed_timestep_embedder_linear_1", "time_text_embed_timestep_embedder_linear_2"]
# Saved as `lycoris_<diffusers path>`, the names ComfyUI maps onto its fused FLUX.1 weights.
UNET_MODULES = sorted([f"lycoris_transformer_blocks_{i}_{n}" for i in range(2) for n in DOUBLE_0]
                      + [f"lycoris_single_transformer_blocks_{i}_{n}" for i in range(3) for n in SINGLE_0]
                      + [f"lycoris_{n}" for n in EMBEDDERS])
PARTS = {
    "locon": ["alpha", "lora_down.weight", "lora_up.weight"],
    "loha": ["alpha", "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"],
    "lokr": ["alpha", "lokr_w1", "lokr_w2", "lokr_w2_a", "lokr_w2_b"],
    "full": ["diff", "diff_b"],
    "ia3": ["on_input", "weight"],
    "diag-oft": ["alpha", "oft_blocks"],
    "boft": ["alpha", "oft_blocks"],
    "dylora": ["alpha", "lora_down.weight", "lora_up.weight"],
}
# BOFT factors each output size as (even m <= rank) x 2^p: the tiny model's 192 = 6 x 32 needs rank >= 6.
RANK = {"boft": "8"}


def flux_output(family, components) -> torch.Tensor:
    """The transformer's prediction for a fixed caption, latent and timestep (text encoders included)."""
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 16, 8, 8, generator=g)
    with torch.no_grad():
        text = family.encode_text(components, family.tokenize(components, ["sks toy"], None), None)
        return family.predict(components, latents, torch.tensor([500]), text, {})


def train(tmp_path, algo, steps=2, extra=(), network_args=()):
    data = make_dataset(str(tmp_path), n=1)
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), "tiny:flux", steps=steps, extra=[
        "--network_module", "lycoris.kohya", "--learning_rate", "1e-2", "--t5xxl_max_token_length", "16",
        "--network_dim", RANK.get(algo, "4"), *extra, "--network_args", f"algo={algo}", *network_args]), "flux")
    return trainer, trainer.run()


def test_preset_with_aliases_adds_the_family_classes_after_the_named_ones():
    aliases = (("DoubleStreamBlock", "FluxTransformerBlock"), ("SingleStreamBlock", "FluxSingleTransformerBlock"))
    preset = {"enable_conv": False, "unet_target_module": ["Transformer2DModel", "DoubleStreamBlock"],
              "text_encoder_target_module": ["CLIPAttention"], "unet_target_name": ["proj_out"],
              "module_algo_map": {"SingleStreamBlock": {"algo": "lokr"}}}
    assert preset_with_aliases(preset, aliases) == {
        "enable_conv": False, "unet_target_module": ["Transformer2DModel", "DoubleStreamBlock", "FluxTransformerBlock"],
        "text_encoder_target_module": ["CLIPAttention"], "unet_target_name": ["proj_out"],
        "module_algo_map": {"SingleStreamBlock": {"algo": "lokr"}, "FluxSingleTransformerBlock": {"algo": "lokr"}}}
    assert preset["unet_target_module"] == ["Transformer2DModel", "DoubleStreamBlock"]  # the input is not changed
    assert preset_with_aliases(preset, ()) == preset


def test_saved_names_are_comfyui_lycoris_paths_for_the_transformer_and_kohya_names_for_clip(tiny_flux):
    family = get_family("flux")
    components = tiny_flux
    mapping = kohya_name_map(family.lora_targets(components))
    transformer = {k: v for k, v in mapping.items() if k.startswith("lora_unet_")}
    # one naming for the whole transformer: ComfyUI's `lycoris_` + the diffusers path
    assert all(v == "lycoris_" + k[len("lora_unet_"):] for k, v in transformer.items())
    assert transformer["lora_unet_transformer_blocks_0_attn_to_q"] == "lycoris_transformer_blocks_0_attn_to_q"
    assert transformer["lora_unet_single_transformer_blocks_2_proj_mlp"] == "lycoris_single_transformer_blocks_2_proj_mlp"
    # CLIP-L (transformers 5 has no `text_model.` level): 72 Linear, 25 LayerNorm, 2 Embedding
    clip = {k: v for k, v in mapping.items() if not k.startswith("lora_unet_")}
    assert len(clip) == 99 and {k.split("_")[1] for k in clip} == {"te1"}
    assert mapping["lora_te1_encoder_layers_0_self_attn_q_proj"] == "lora_te1_text_model_encoder_layers_0_self_attn_q_proj"


@pytest.mark.parametrize("algo", list(PARTS))
def test_lycoris_algo_trains_saves_and_reloads_on_flux(tmp_path, algo):
    trainer, path = train(tmp_path, algo, extra=["--network_train_unet_only"])
    saved = load_file(path)
    assert sorted({k.split(".", 1)[0] for k in saved}) == UNET_MODULES
    assert sorted({k.split(".", 1)[1] for k in saved}) == PARTS[algo]
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    assert metadata["ss_network_module"] == "lycoris.kohya"
    assert json.loads(metadata["ss_network_args"]) == {"algo": algo}
    assert metadata["ss_base_model_version"] == "flux1"

    family = trainer.family
    trainer.accelerator.unwrap_model(trainer.network).eval()
    trained = flux_output(family, trainer.components)
    fresh = family.load(LoadOptions("tiny:flux", family_options=trainer.components.options))
    assert not torch.allclose(flux_output(family, fresh), trained), "training changed nothing"
    if algo == "dylora":
        return  # LyCORIS saves DyLoRA as plain lora_down/lora_up and cannot load it back into DyLoRA
    # The same arguments (and the family's preset aliases) rebuild the network; its state loads strictly.
    network = network_kind("lycoris.kohya").create(family, fresh, NetworkOptions(
        network_module="lycoris.kohya", network_dim=int(RANK.get(algo, "4")), network_alpha=4,
        network_args={"algo": algo}))
    network.apply_to(fresh.text_encoders, fresh.denoiser, False, True)
    missing, unexpected = network.load_state_dict(external_state_dict(path, family, fresh), strict=False)
    assert not unexpected and not [k for k in missing if not k.endswith("org_weight")], (missing, unexpected)
    network.eval()
    torch.testing.assert_close(flux_output(family, fresh), trained, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("algo", ["locon", "loha", "lokr"])
def test_lycoris_create_network_from_weights_rebuilds_the_trained_flux_network(tmp_path, algo):
    trainer, path = train(tmp_path, algo, extra=["--network_train_unet_only"])
    family = trainer.family
    trainer.accelerator.unwrap_model(trainer.network).eval()
    trained = flux_output(family, trainer.components)
    fresh = family.load(LoadOptions("tiny:flux", family_options=trainer.components.options))
    network, _ = lycoris_kohya.create_network_from_weights(1.0, path, fresh.vae, fresh.text_encoders, fresh.denoiser,
                                                           weights_sd=external_state_dict(path, family, fresh))
    assert len(network.unet_loras) == len(UNET_MODULES)
    network.apply_to(fresh.text_encoders, fresh.denoiser, False, True)
    network.eval()
    torch.testing.assert_close(flux_output(family, fresh), trained, rtol=1e-4, atol=1e-5)


def test_locon_with_clip_samples_and_resumes_exactly(tmp_path):
    """CLIP-L trains too (kohya lora_te1_text_model_* names); sampling runs; a resumed run equals a straight one."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("sks toy --w 64 --h 64 --s 1\n")
    extra = ["--save_every_n_steps", "2", "--save_state"]
    trainer, straight = train(tmp_path / "a", "locon", steps=3, network_args=["preset=attn-mlp"], extra=extra + [
        "--sample_prompts", str(prompts), "--sample_every_n_steps", "3"])
    saved = load_file(straight)
    te = sorted({k.split(".", 1)[0] for k in saved if k.startswith("lora_te")})
    assert len(te) == 72 and te[:2] == ["lora_te1_text_model_encoder_layers_0_mlp_fc1",
                                        "lora_te1_text_model_encoder_layers_0_mlp_fc2"]
    assert len(glob.glob(os.path.join(str(tmp_path / "a" / "out"), "sample", "lora_000003_00_*.png"))) == 1

    state = os.path.join(str(tmp_path / "a" / "out"), "lora-step00000002-state")
    assert os.path.isdir(state)
    _, resumed = train(tmp_path / "b", "locon", steps=3, network_args=["preset=attn-mlp"],
                       extra=extra + ["--resume", state])
    again = load_file(resumed)
    assert saved.keys() == again.keys()
    assert all(torch.equal(saved[k], again[k]) for k in saved)

    # --network_weights: the kohya-named file loads back (CLIP renames undone), with the same outputs
    family = trainer.family
    trainer.accelerator.unwrap_model(trainer.network).eval()
    trained = flux_output(family, trainer.components)
    fresh = family.load(LoadOptions("tiny:flux", family_options=trainer.components.options))
    network = network_kind("lycoris.kohya").create(family, fresh, NetworkOptions(
        network_module="lycoris.kohya", network_dim=4, network_alpha=4,
        network_args={"algo": "locon", "preset": "attn-mlp"}))
    network.apply_to(fresh.text_encoders, fresh.denoiser, True, True)
    info = load_network_weights(network, family, straight, kohya_name_map(family.lora_targets(fresh)))
    assert not info.unexpected_keys and not info.missing_keys
    network.eval()
    torch.testing.assert_close(flux_output(family, fresh), trained, rtol=1e-4, atol=1e-5)


def test_lycoris_arguments_it_refuses_are_one_line_config_errors(tmp_path):
    data = make_dataset(str(tmp_path), n=1)
    argv = base_args(data, str(tmp_path / "out"), "tiny:flux", steps=1, extra=[
        "--network_module", "lycoris.kohya", "--network_train_unet_only", "--network_args", "algo=boft"])
    with pytest.raises(ConfigError, match=r"^--network_module lycoris.kohya --network_args algo=boft: It is "
                                          r"impossible to decompose 192 with factor 4 under BOFT constraints.$"):
        make_trainer(argv, "flux").run()


def test_generation_applies_a_lycoris_flux_file_with_the_trained_output(tmp_path):
    from library.train.adapters.network_apply import NetworkSpec, apply_networks

    trainer, path = train(tmp_path, "lokr", extra=["--network_train_unet_only"])
    family = trainer.family
    trainer.accelerator.unwrap_model(trainer.network).eval()
    trained = flux_output(family, trainer.components)
    fresh = family.load(LoadOptions("tiny:flux", family_options=trainer.components.options))
    applied = apply_networks(family, fresh, [NetworkSpec("lycoris.kohya", path, 1.0)], False, torch.device("cpu"),
                             torch.float32)
    assert len(applied.networks[0].unet_loras) == len(UNET_MODULES)
    torch.testing.assert_close(flux_output(family, fresh), trained, rtol=1e-4, atol=1e-5)
