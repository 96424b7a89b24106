"""Z-Image: the tiny preset written as the files users have (a diffusers folder, ComfyUI's single files) and loaded
back by the real loaders, the original layout against diffusers' own converter, ComfyUI's kohya LoRA names (fused
qkv) on the tiny and the full-size model, text as diffusers' ZImagePipeline encodes it, predict against the pipeline's
call, a short LoRA training run with sampling, generation with the LoRA, a full fine-tune saving a file that loads
back, and the text-encoder / latent caches."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from library.core.errors import ConfigError
from library.families import get_family
from library.families.base import LoadOptions, ModelLoadError
from library.families.zimage import layout
from library.families.zimage.configs import CHAT_TEMPLATE, PRESETS, build_zimage_modules, transformer_config
from library.families.zimage.loading import write_zimage_preset
from library.families.zimage.options import ZImageOptions
from networks.lora import create_network
from tests.train_helpers import (apply_lora_file, assert_lora_changes_generation, assert_merged_in_original_layout,
                                 assert_only_denoiser_moved, assert_pipeline_lora_predicts_as_ours, assert_same_weights,
                                 assert_template_passes_check_config, assert_written_files_load_as_the_preset,
                                 fine_tune_one_step, random_lora_file, train_tiny_lora_with_sample, web_ui_template)

# ComfyUI's kohya names of one main block with musubi-tuner's default targets (no refiners, no AdaLN)
BLOCK_LORA_NAMES = ("attention_qkv", "attention_out", "feed_forward_w1", "feed_forward_w2", "feed_forward_w3")


@pytest.fixture(scope="module")
def zimage_files(tmp_path_factory):
    return write_zimage_preset("tiny:zimage", str(tmp_path_factory.mktemp("zimage-files")))


@pytest.fixture(scope="module")
def tiny_zimage():
    return get_family("zimage").load(LoadOptions("tiny:zimage"))


def test_original_layout_matches_diffusers_converter_at_full_size():
    """Our original (ComfyUI) names of the 6B model: 30 + 2 + 2 blocks, fused qkv of 3 x 3840 rows; diffusers' own
    single-file converter turns them back into exactly the model's keys and shapes."""
    from diffusers import ZImageTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    with torch.device("meta"):
        model = ZImageTransformer2DModel(**transformer_config(PRESETS["random:zimage"]))
    state = model.state_dict()
    original = layout.to_original(state)
    # 32 modulated blocks x 13 tensors, 2 context refiner blocks x 11, 15 outside (embedders, final layer, pads)
    assert len(original) == 32 * 13 + 2 * 11 + 15
    assert original["layers.0.attention.qkv.weight"].shape == (3 * 3840, 3840)
    assert original["x_embedder.weight"].shape == (3840, 64)
    converted = convert_z_image_transformer_checkpoint_to_diffusers(dict(original))
    assert {k: tuple(v.shape) for k, v in converted.items()} == {k: tuple(v.shape) for k, v in state.items()}


def test_tiny_files_load_through_the_real_loaders(zimage_files, tiny_zimage):
    """The diffusers folder (by ZImagePipeline.from_pretrained and by the family), the ComfyUI DiT file (by
    diffusers' from_single_file and by the family, plain and under model.diffusion_model.) give the preset's weights."""
    from diffusers import ZImagePipeline, ZImageTransformer2DModel

    assert_written_files_load_as_the_preset("zimage", zimage_files, tiny_zimage, ZImageOptions, "qwen3")
    pipe = ZImagePipeline.from_pretrained(zimage_files["diffusers"])
    assert_same_weights(pipe.transformer, tiny_zimage.denoiser)
    by_diffusers = ZImageTransformer2DModel.from_single_file(
        zimage_files["dit"], config=os.path.join(zimage_files["diffusers"], "transformer"))
    assert_same_weights(by_diffusers, tiny_zimage.denoiser)
    with safe_open(zimage_files["dit"], "pt") as f:
        keys = set(f.keys())
    assert {"layers.0.attention.qkv.weight", "layers.0.adaLN_modulation.0.weight", "x_embedder.weight",
            "final_layer.adaLN_modulation.1.weight", "cap_pad_token", "noise_refiner.1.attention.k_norm.weight"} <= keys


def test_option_errors_are_one_line(zimage_files):
    family = get_family("zimage")
    with pytest.raises(ModelLoadError, match=r"^--qwen3: required with a Z-Image DiT file"):
        family.load(LoadOptions(zimage_files["dit"]))
    with pytest.raises(ConfigError, match=r"^--qwen3_max_token_length: expected an integer from 16"):
        ZImageOptions(qwen3_max_token_length=4).check()
    with pytest.raises(ModelLoadError, match=r"^--qwen3 .*: expected a Qwen3 text encoder"):
        family.load(LoadOptions(zimage_files["dit"], family_options=ZImageOptions(qwen3=zimage_files["ae"])))


def _unet_names(family, components, **kwargs) -> list[str]:
    network = create_network(1.0, 4, 4.0, components.vae, components.text_encoders, components.denoiser,
                             lora_targets=family.lora_targets(components), **kwargs)
    return sorted(m.lora_name for m in network.unet_loras)


def test_lora_names_tiny_and_full_size_on_meta():
    """Golden counts: musubi-tuner's default (main blocks only) is 5 ComfyUI modules per block: 2 tiny, 30 full;
    with train_refiners and train_modulation, 6 per modulated block and 5 per context refiner block."""
    family = get_family("zimage")
    for preset, layers in (("tiny:zimage", 2), ("random:zimage", 30)):
        parts = build_zimage_modules(preset, device="meta")
        from library.families.base import Components

        components = Components(denoiser=parts["transformer"], vae=None, text_encoders=[parts["text_encoder"]],
                                tokenizers=[parts["tokenizer"]])
        names = _unet_names(family, components)
        assert len(names) == 5 * layers
        assert names[:5] == [f"lora_unet_layers_0_{n}" for n in sorted(BLOCK_LORA_NAMES)]
        every = _unet_names(family, components, train_refiners="True", train_modulation="True")
        assert len(every) == 6 * (layers + 2) + 5 * 2
        assert "lora_unet_noise_refiner_1_adaLN_modulation_0" in every
        assert "lora_unet_context_refiner_0_attention_qkv" in every
        assert not any("adaLN" in n for n in every if "context_refiner" in n)
    # Qwen3-4B (36 layers): q, k, v, o, gate, up, down per layer
    network = create_network(1.0, 4, 4.0, None, components.text_encoders, components.denoiser,
                             lora_targets=family.lora_targets(components))
    assert len(network.text_encoder_loras) == 36 * 7


def test_text_is_the_pipelines(tiny_zimage):
    """The chat template of diffusers' ZImagePipeline, Qwen3's second-to-last hidden states; the pipeline's own
    encode_prompt gives the same unpadded embeddings."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    family = get_family("zimage")
    c = tiny_zimage
    ids, mask = family.tokenize(c, ["a red cube"], None)
    assert ids.shape == (1, 512)
    assert c.tokenizers[0].decode(ids[0][mask[0].bool()]) == CHAT_TEMPLATE.format("a red cube")
    ours = family.encode_text(c, [ids, mask], None).tensors
    pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=c.vae, text_encoder=c.text_encoders[0],
                          tokenizer=c.tokenizers[0], transformer=c.denoiser)
    theirs = pipe.encode_prompt(["a red cube"], device="cpu", do_classifier_free_guidance=False)[0][0]
    torch.testing.assert_close(ours["hidden_state"][0][mask[0].bool()], theirs, rtol=0, atol=0)


def test_predict_is_the_negated_model_output_at_one_minus_sigma(tiny_zimage):
    family = get_family("zimage")
    c = tiny_zimage
    text = family.encode_text(c, family.tokenize(c, ["a cat", "a red dog on a hill"], None), None)
    x = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = family.predict(c, x, torch.tensor([300.0, 800.0]), text, {})
        mask = text.tensors["attention_mask"].bool()
        caps = [text.tensors["hidden_state"][i][mask[i]] for i in range(2)]
        direct = c.denoiser([x[0].unsqueeze(1), x[1].unsqueeze(1)], torch.tensor([0.7, 0.2]), caps,
                            return_dict=False)[0]
    torch.testing.assert_close(ours, -torch.stack(direct).squeeze(2))


def test_tiny_zimage_lora_training_run_samples_and_generates(tmp_path, zimage_files):
    """zimage_train_network.py's run: 2 steps with networks.lora_zimage, cached text-encoder outputs and latents,
    a sample at step 2; the file has ComfyUI's names and musubi-tuner's defaults in its metadata; tools/generate.py's
    path (family.generate with the LoRA applied) makes an image."""
    path, keys, metadata, up = train_tiny_lora_with_sample(tmp_path, "tiny:zimage", "zimage", "networks.lora_zimage", [
        "--qwen3_max_token_length", "32"], "lora_unet_layers_0_attention_qkv.lora_up.weight")
    assert len(keys) == 2 * 5 * 3 and all(k.startswith("lora_unet_layers_") for k in keys)
    assert up.shape == (3 * 64, 4) and up.abs().sum() > 0  # trained
    assert (metadata["ss_base_model_version"], metadata["modelspec.architecture"], metadata["ss_network_module"]) \
        == ("zimage", "z-image/lora", "networks.lora_zimage")
    assert (metadata["ss_timestep_sampling"], metadata["ss_discrete_flow_shift"], metadata["ss_weighting_scheme"]) \
        == ("shift", "2.0", "none")
    # tools/generate.py on the diffusers folder with the LoRA; its multiplier changes the image
    assert_lora_changes_generation(tmp_path, zimage_files["diffusers"], "networks.lora_zimage", path)


def test_full_fine_tune_saves_a_comfy_dit_file_that_loads_back(tmp_path, zimage_files, tiny_zimage):
    """zimage_train.py: one step from the diffusers folder, text-encoder outputs and latents cached to disk; the saved
    DiT has exactly the ComfyUI file's keys, loads back through the single-file loader, and only the DiT moved."""
    path, data = fine_tune_one_step(tmp_path, "zimage", zimage_files["diffusers"], [
        "--qwen3_max_token_length", "32", "--cache_text_encoder_outputs", "--cache_text_encoder_outputs_to_disk",
        "--cache_latents", "--cache_latents_to_disk"], "z-image", zimage_files["dit"])
    cached = sorted(n for n in os.listdir(os.path.join(data, "5_sks toy")) if n.endswith(".npz"))
    assert len(cached) == 2 and any(n.endswith("_zimage_te.npz") for n in cached) \
        and any(n.endswith("_zimage.npz") for n in cached), cached
    loaded = get_family("zimage").load(LoadOptions(path, family_options=ZImageOptions(
        qwen3=zimage_files["qwen3"], ae=zimage_files["ae"])))
    assert_only_denoiser_moved(loaded, tiny_zimage)


@pytest.mark.parametrize("mode", ["lora", "finetune"])
def test_web_ui_templates_pass_the_scripts_check(tmp_path, mode):
    """webui/templates/zimage_<mode>.toml, its model paths swapped for the tiny preset and AdamW for AdamW8bit (no
    bitsandbytes here), passes the script's own --check_config; the LoRA template names networks.lora_zimage and
    musubi-tuner's Z-Image defaults."""
    template = web_ui_template("zimage", mode)
    config = template["config"]
    assert (config["training"]["timestep_sampling"], config["training"]["weighting_scheme"],
            config["training"]["discrete_flow_shift"]) == ("shift", "none", 2.0)
    assert ("network" in config) == (mode == "lora")
    if mode == "lora":
        assert config["network"]["network_module"] == "networks.lora_zimage"
    assert_template_passes_check_config(tmp_path, "zimage", mode, template, "tiny:zimage")


def test_diffusers_pipeline_loads_our_lora_file_and_predicts_the_same(tmp_path):
    """ZImagePipeline.load_lora_weights reads our ComfyUI-named file (the fused qkv split onto to_q / to_k / to_v
    by diffusers' own Z-Image converter) and the transformer predicts what our network predicts (measured
    difference 0.0 on the tiny model; 1e-6 allowed)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline


    family = get_family("zimage")
    ours, theirs = (family.load(LoadOptions("tiny:zimage")) for _ in range(2))
    path = random_lora_file(family, ours, str(tmp_path / "lora.safetensors"))
    apply_lora_file(family, ours, path)
    pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=theirs.vae,
                          text_encoder=theirs.text_encoders[0], tokenizer=theirs.tokenizers[0],
                          transformer=theirs.denoiser)
    pipe.load_lora_weights({k: v for k, v in load_file(path).items() if k.startswith("lora_unet_")})
    assert {n for n, _ in theirs.denoiser.named_modules() if n.endswith(".lora_A")} == {
        f"layers.{i}.{m}.lora_A" for i in range(2) for m in ("attention.to_q", "attention.to_k", "attention.to_v",
                                                             "attention.to_out.0", "feed_forward.w1",
                                                             "feed_forward.w2", "feed_forward.w3")}
    assert_pipeline_lora_predicts_as_ours(family, ours, theirs, 16)


def test_merge_tool_writes_the_merged_comfy_dit(tmp_path, zimage_files, tiny_zimage):
    """tools/merge_lora.py on ComfyUI's files (--qwen3 / --ae as training takes them): the saved DiT has the file's
    keys and each LoRA'd weight is the original plus up @ down · alpha / rank, computed here in the original layout
    (the fused qkv's up stacks the q, k, v slices over one down)."""
    from tools import merge_lora

    family = get_family("zimage")
    lora_path = random_lora_file(family, tiny_zimage, str(tmp_path / "lora.safetensors"))
    out = str(tmp_path / "merged.safetensors")
    assert merge_lora.main(["--sd_model", zimage_files["dit"], "--qwen3", zimage_files["qwen3"], "--ae",
                            zimage_files["ae"], "--models", lora_path, "--ratios", "1.0", "--save_to", out]) == 0
    modules = [f"layers.{i}.{m}" for i in range(2)
               for m in ("attention.qkv", "attention.out", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")]
    assert_merged_in_original_layout(out, zimage_files["dit"], lora_path, modules)
