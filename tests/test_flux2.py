"""FLUX.2 klein: the tiny preset written as the files users have (a diffusers folder, ComfyUI's single files) and
loaded back by the real loaders, BFL's original layout against diffusers' own converter, ComfyUI's kohya LoRA names
(fused qkv) on the tiny and the full-size models, text and sampling as diffusers' Flux2KleinPipeline, a short LoRA
training run with sampling, generation with the LoRA, our LoRA file in the diffusers pipeline, a full fine-tune saving
a file that loads back, block swap."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from library.core.errors import ConfigError
from library.families import get_family
from library.families.base import Components, LoadOptions, ModelLoadError
from library.families.flux2 import layout
from library.families.flux2.configs import CHAT_TEMPLATE, PRESETS, build_flux2_modules, transformer_config
from library.families.flux2.family import patchify
from library.families.flux2.generate import flux2_sigmas
from library.families.flux2.loading import write_flux2_preset
from library.families.flux2.options import Flux2Options
from networks.lora import create_network, create_network_from_weights
from tests.train_helpers import (apply_lora_file, assert_lora_changes_generation, assert_merged_in_original_layout,
                                 assert_only_denoiser_moved, assert_pipeline_lora_predicts_as_ours, assert_same_weights,
                                 assert_template_passes_check_config, assert_written_files_load_as_the_preset,
                                 base_args, fine_tune_one_step, make_dataset, make_trainer, random_lora_file,
                                 train_tiny_lora_with_sample, web_ui_template)

# ComfyUI's kohya names of one double block and one single block
DOUBLE_LORA_NAMES = ("img_attn_proj", "img_attn_qkv", "img_mlp_0", "img_mlp_2", "txt_attn_proj", "txt_attn_qkv",
                     "txt_mlp_0", "txt_mlp_2")
SINGLE_LORA_NAMES = ("linear1", "linear2")


@pytest.fixture(scope="module")
def flux2_files(tmp_path_factory):
    return write_flux2_preset("tiny:flux2", str(tmp_path_factory.mktemp("flux2-files")))


@pytest.fixture(scope="module")
def tiny_flux2():
    return get_family("flux2").load(LoadOptions("tiny:flux2", family_options=Flux2Options(qwen3_max_token_length=64)))


def test_original_layout_matches_diffusers_converter():
    """Our BFL names of klein 4B (on meta: 5 double blocks x 12 tensors, 20 single x 4, 9 outside) go back to exactly
    the model's keys and shapes through diffusers' own converter; on the tiny model, to the same values (the final
    AdaLN's halves swapped and swapped back)."""
    from diffusers import Flux2Transformer2DModel

    with torch.device("meta"):
        model = Flux2Transformer2DModel(**transformer_config(PRESETS["random:flux2"]))
    state = model.state_dict()
    original = layout.to_original(state)
    assert len(original) == 5 * 12 + 20 * 4 + 9
    assert original["double_blocks.0.img_attn.qkv.weight"].shape == (3 * 3072, 3072)
    assert original["txt_in.weight"].shape == (3072, 3 * 2560)
    assert original["img_in.weight"].shape == (3072, 128)
    converted = layout.to_diffusers(dict(original))
    assert {k: tuple(v.shape) for k, v in converted.items()} == {k: tuple(v.shape) for k, v in state.items()}
    tiny = build_flux2_modules("tiny:flux2")["transformer"].state_dict()
    tiny_original = layout.to_original(tiny)
    half = tiny["norm_out.linear.weight"].shape[0] // 2
    assert torch.equal(tiny_original["final_layer.adaLN_modulation.1.weight"][:half],
                       tiny["norm_out.linear.weight"][half:])
    back = layout.to_diffusers(dict(tiny_original))
    assert back.keys() == tiny.keys() and all(torch.equal(back[k], tiny[k]) for k in tiny)


def test_tiny_files_load_through_the_real_loaders(flux2_files, tiny_flux2):
    """The diffusers folder (by Flux2KleinPipeline.from_pretrained and by the family), the ComfyUI DiT file (by
    diffusers' from_single_file and by the family, plain and under model.diffusion_model.) with --qwen3 / --ae give
    the preset's weights, batch-norm statistics included; detection tells FLUX.2 from FLUX.1."""
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel

    assert_written_files_load_as_the_preset("flux2", flux2_files, tiny_flux2, Flux2Options, "qwen3")
    assert tiny_flux2.vae.bn.running_var.min() > 0.5 - 1e-6 and tiny_flux2.vae.bn.running_mean.abs().max() > 0
    pipe = Flux2KleinPipeline.from_pretrained(flux2_files["diffusers"])
    assert_same_weights(pipe.transformer, tiny_flux2.denoiser)
    assert_same_weights(pipe.text_encoder.model, tiny_flux2.text_encoders[0])
    by_diffusers = Flux2Transformer2DModel.from_single_file(
        flux2_files["dit"], config=os.path.join(flux2_files["diffusers"], "transformer"))
    assert_same_weights(by_diffusers, tiny_flux2.denoiser)
    with safe_open(flux2_files["dit"], "pt") as f:
        keys = set(f.keys())
    assert {"double_blocks.0.img_attn.qkv.weight", "double_blocks.1.txt_attn.norm.key_norm.scale",
            "single_blocks.0.linear1.weight", "single_stream_modulation.lin.weight", "img_in.weight",
            "final_layer.adaLN_modulation.1.weight", "time_in.in_layer.weight"} <= keys


def test_option_errors_are_one_line(flux2_files):
    family = get_family("flux2")
    with pytest.raises(ModelLoadError, match=r"^--qwen3: required with a FLUX.2 \[klein\] DiT file"):
        family.load(LoadOptions(flux2_files["dit"]))
    with pytest.raises(ConfigError, match=r"^--qwen3_max_token_length: expected an integer from 16"):
        Flux2Options(qwen3_max_token_length=4).check()
    with pytest.raises(ModelLoadError, match=r"^--qwen3 .*: expected a Qwen3 text encoder"):
        family.load(LoadOptions(flux2_files["dit"], family_options=Flux2Options(qwen3=flux2_files["ae"])))
    with pytest.raises(ModelLoadError, match=r"^--ae .*: expected the FLUX.2 autoencoder"):
        family.load(LoadOptions(flux2_files["dit"], family_options=Flux2Options(qwen3=flux2_files["qwen3"],
                                                                                ae=flux2_files["qwen3"])))


def test_lora_names_tiny_and_full_size_on_meta():
    """Golden counts: 8 ComfyUI modules per double block (q, k, v fused per stream), 2 per single block: tiny 2 + 3
    blocks = 22, klein 4B 5 + 20 = 80, klein 9B 8 + 24 = 112; Qwen3 (36 layers): 7 per layer."""
    family = get_family("flux2")
    for preset, double, single in (("tiny:flux2", 2, 3), ("random:flux2", 5, 20), ("random:flux2_9b", 8, 24)):
        parts = build_flux2_modules(preset, device="meta")
        components = Components(denoiser=parts["transformer"], vae=None, text_encoders=[parts["text_encoder"]],
                                tokenizers=[parts["tokenizer"]])
        network = create_network(1.0, 4, 4.0, None, components.text_encoders, components.denoiser,
                                 lora_targets=family.lora_targets(components))
        names = sorted(m.lora_name for m in network.unet_loras)
        assert len(names) == 8 * double + 2 * single
        assert set(names) == {f"lora_unet_double_blocks_{i}_{n}" for i in range(double) for n in DOUBLE_LORA_NAMES} \
            | {f"lora_unet_single_blocks_{i}_{n}" for i in range(single) for n in SINGLE_LORA_NAMES}
        assert len(network.text_encoder_loras) == 7 * PRESETS[preset].qwen_layers


def test_text_and_sampling_are_the_pipelines(flux2_files, tiny_flux2):
    """Qwen3's layers 9/18/27 of the caption in the chat template are Flux2KleinPipeline.encode_prompt's embeddings
    (bit for bit), and 3 Euler steps of ours from the same noise end at the pipeline's latents (measured difference
    0.0 on the tiny model; 1e-6 allowed: the σ schedule is computed by other code)."""
    from diffusers import Flux2KleinPipeline

    family = get_family("flux2")
    c = tiny_flux2
    captions = ["a red cube on a hill", "a cat"]
    ids, mask = family.tokenize(c, captions, None)
    assert ids.shape == (2, 64)
    assert c.tokenizers[0].decode(ids[0][mask[0].bool()]) == CHAT_TEMPLATE.format(captions[0])
    text = family.encode_text(c, [ids, mask], None)
    pipe = Flux2KleinPipeline.from_pretrained(flux2_files["diffusers"])
    embeds, _ = pipe.encode_prompt(captions, device="cpu", max_sequence_length=64)
    assert embeds.shape == (2, 64, 96)
    torch.testing.assert_close(text.tensors["hidden_state"], embeds, rtol=0, atol=0)
    noise = torch.randn(2, 32, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = pipe(prompt_embeds=embeds, latents=patchify(noise), height=64, width=64, num_inference_steps=3,
                      guidance_scale=1.0, output_type="latent", return_dict=False)[0]
        sigmas = flux2_sigmas(3, 16)
        latents = noise
        for sigma, sigma_next in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
            v = family.predict(c, latents, torch.full((2,), sigma * 1000), text, {})
            latents = latents + (sigma_next - sigma) * v
        ours = family.denormalize_latents(c.vae, latents)
    torch.testing.assert_close(sigmas, pipe.scheduler.sigmas.float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    # encode_images normalises by the batch norm of the 2x2 patches: the pipeline's _encode_vae_image (which takes
    # the posterior's mode), unpatchified; training draws from the posterior with the generator
    image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        expected = pipe._encode_vae_image(image, None)
        dist = c.vae.encode(image).latent_dist
        mode = family.normalize_latents(c.vae, dist.mode())
        drawn = family.encode_images(c.vae, image, torch.Generator().manual_seed(5))
        sample = family.normalize_latents(c.vae, dist.sample(generator=torch.Generator().manual_seed(5)))
    assert expected.shape == (1, 128, 4, 4) and mode.shape == (1, 32, 8, 8)
    torch.testing.assert_close(patchify(mode), expected, rtol=0, atol=0)
    torch.testing.assert_close(drawn, sample, rtol=0, atol=0)
    torch.testing.assert_close(family.denormalize_latents(c.vae, mode), dist.mode(), rtol=1e-5, atol=1e-5)


def test_tiny_flux2_lora_training_run_samples_and_generates(tmp_path, flux2_files):
    """flux2_train_network.py's run: 2 steps with networks.lora_flux2, cached text-encoder outputs and latents,
    a sample at step 2; the file has ComfyUI's names and the FLUX.2 defaults in its metadata; tools/generate.py's
    path (family.generate with the LoRA applied) makes an image."""
    path, keys, metadata, up = train_tiny_lora_with_sample(tmp_path, "tiny:flux2", "flux2", "networks.lora_flux2", [
        "--qwen3_max_token_length", "32"], "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight")
    assert len(keys) == 3 * 22 and all(k.startswith(("lora_unet_double_blocks_", "lora_unet_single_blocks_"))
                                       for k in keys)
    assert up.shape == (3 * 32, 4) and up.abs().sum() > 0  # trained
    assert (metadata["ss_base_model_version"], metadata["modelspec.architecture"], metadata["ss_network_module"]) \
        == ("flux2", "flux-2-klein/lora", "networks.lora_flux2")
    assert (metadata["ss_timestep_sampling"], metadata["ss_weighting_scheme"]) == ("flux_shift", "none")
    assert_lora_changes_generation(tmp_path, flux2_files["diffusers"], "networks.lora_flux2", path)


def test_diffusers_pipeline_loads_our_lora_file_and_predicts_the_same(tmp_path):
    """Flux2KleinPipeline.load_lora_weights reads our ComfyUI-named file (diffusers' own kohya FLUX.2 converter splits
    the fused qkv) with every module of ours placed, and the transformer predicts what our network predicts
    (measured difference below 1e-7 on the tiny model; 1e-6 allowed)."""
    from diffusers import Flux2KleinPipeline

    from library.families.flux2.loading import scheduler

    family = get_family("flux2")
    options = Flux2Options(qwen3_max_token_length=16)
    ours, theirs = (family.load(LoadOptions("tiny:flux2", family_options=options)) for _ in range(2))
    path = random_lora_file(family, ours, str(tmp_path / "lora.safetensors"))
    apply_lora_file(family, ours, path)
    pipe = Flux2KleinPipeline(scheduler=scheduler(), vae=theirs.vae, text_encoder=theirs.text_encoders[0],
                              tokenizer=theirs.tokenizers[0], transformer=theirs.denoiser)
    pipe.load_lora_weights({k: v for k, v in load_file(path).items() if k.startswith("lora_unet_")})
    double = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
              "attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out", "ff_context.linear_in",
              "ff_context.linear_out")
    assert {n for n, _ in theirs.denoiser.named_modules() if n.endswith(".lora_A")} == {
        f"transformer_blocks.{i}.{m}.lora_A" for i in range(2) for m in double} | {
        f"single_transformer_blocks.{i}.{m}.lora_A" for i in range(3) for m in ("attn.to_qkv_mlp_proj", "attn.to_out")}
    assert_pipeline_lora_predicts_as_ours(family, ours, theirs, 32)


def test_full_fine_tune_saves_a_comfy_dit_file_that_loads_back(tmp_path, flux2_files, tiny_flux2):
    """flux2_train.py: one step from the diffusers folder, text-encoder outputs and latents cached to disk; the saved
    DiT has exactly the ComfyUI file's keys, loads back through the single-file loader, and only the DiT moved."""
    path, data = fine_tune_one_step(tmp_path, "flux2", flux2_files["diffusers"], [
        "--qwen3_max_token_length", "32", "--cache_text_encoder_outputs", "--cache_text_encoder_outputs_to_disk",
        "--cache_latents", "--cache_latents_to_disk"], "flux-2-klein", flux2_files["dit"])
    cached = sorted(n for n in os.listdir(os.path.join(data, "5_sks toy")) if n.endswith(".npz"))
    assert len(cached) == 2 and any(n.endswith("_flux2_te.npz") for n in cached) \
        and any(n.endswith("_flux2.npz") for n in cached), cached
    loaded = get_family("flux2").load(LoadOptions(path, family_options=Flux2Options(
        qwen3=flux2_files["qwen3"], ae=flux2_files["ae"])))
    assert_only_denoiser_moved(loaded, tiny_flux2)


def test_fp8_base_and_block_swap_train_as_float8_rounded_weights(tmp_path):
    """--fp8_base_unet --blocks_to_swap 1 (the last single-stream block streamed, float8 Linears in the DiT) gives the
    losses and LoRA of a run whose DiT weights were rounded through float8 at load (measured 0.0 and 0.0 here; 1e-5
    and 1e-4 allowed as tests/test_memory_options.py for FLUX.1); more than blocks - 2 is refused before loading."""
    from library.train.memory.fp8 import fp8_layers, fp8_round_trip_
    from tests.train_helpers import assert_close_measured, largest_lora_up

    data = make_dataset(str(tmp_path / "data"), n=2)
    extra = ["--network_module", "networks.lora_flux2", "--qwen3_max_token_length", "16",
             "--network_train_unet_only", "--cache_text_encoder_outputs"]

    def train(name, more, rounded=False):
        trainer = make_trainer(base_args(data, str(tmp_path / name), "tiny:flux2", steps=2, extra=extra + more),
                               "flux2")
        if rounded:
            load = trainer.family.load

            def load_rounded(opts):
                c = load(opts)
                fp8_round_trip_(c.denoiser)
                return c

            trainer.family.load = load_rounded
        losses = []
        step = trainer._micro_step
        trainer._micro_step = lambda *a: losses.append(step(*a)) or losses[-1]
        return losses, load_file(trainer.run()), trainer

    losses, lora, trainer = train("fp8", ["--fp8_base_unet", "--blocks_to_swap", "1"])
    rounded_losses, rounded_lora, _ = train("rounded", [], rounded=True)
    assert_close_measured(losses, rounded_losses, 1e-5, "flux2 fp8 + swap vs rounded: losses")
    assert_close_measured(lora, rounded_lora, 1e-4, "flux2 fp8 + swap vs rounded: LoRA")
    assert largest_lora_up(lora) > 1e-3
    c = trainer.components
    assert fp8_layers([c.denoiser]) > 0 and fp8_layers(c.text_encoders) == 0
    family = get_family("flux2")
    assert family.swappable_blocks(c, 1) == [c.denoiser.single_transformer_blocks[2]]
    with pytest.raises(ConfigError, match=r"^--blocks_to_swap 2: expected 1\.\.1 for this model \(3 single-stream"):
        family.swappable_blocks(c, 2)
    with pytest.raises(ConfigError, match=r"^--blocks_to_swap 19: expected 1\.\.18"):
        family.check_options(Flux2Options(), LoadOptions("random:flux2"), blocks_to_swap=19)


@pytest.mark.parametrize("mode", ["lora", "finetune"])
def test_web_ui_templates_pass_the_scripts_check(tmp_path, mode):
    """webui/templates/flux2_<mode>.toml, its model paths swapped for the tiny preset and AdamW for AdamW8bit (no
    bitsandbytes here), passes the script's own --check_config; the templates name networks.lora_flux2 and the
    FLUX.2 flow defaults."""
    template = web_ui_template("flux2", mode)
    config = template["config"]
    assert (config["training"]["timestep_sampling"], config["training"]["weighting_scheme"]) == ("flux_shift", "none")
    assert ("network" in config) == (mode == "lora")
    if mode == "lora":
        assert config["network"]["network_module"] == "networks.lora_flux2"
    assert_template_passes_check_config(tmp_path, "flux2", mode, template, "tiny:flux2")


def test_ai_toolkit_and_diffusers_layouts_read_back_as_kohya(tmp_path):
    """A LoRA in ai-toolkit's names (`diffusion_model.<BFL path>.lora_A` / `lora_B`, no alpha) and in diffusers' split
    names (diffusers' own kohya FLUX.2 converter: `transformer.transformer_blocks.0.attn.to_q.lora_A`, scale folded
    in, and with alpha = 2 x rank) become kohya files through the family's converter (what --network_weights
    applies) that predict what the kohya file predicts (measured difference below 1e-6; 1e-5 allowed: the scale is
    folded in another order); a kohya / musubi-tuner file comes back unchanged."""
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux2_lora_to_diffusers

    from library.core.safetensors_io import write_safetensors
    from library.families.flux2.lora_names import to_kohya_lora

    family = get_family("flux2")
    c = family.load(LoadOptions("tiny:flux2", family_options=Flux2Options(qwen3_max_token_length=16)))
    kohya_path = random_lora_file(family, c, str(tmp_path / "kohya.safetensors"))
    kohya = {k: v for k, v in load_file(kohya_path).items() if k.startswith("lora_unet_")}
    assert to_kohya_lora(kohya).keys() == kohya.keys()
    ai_toolkit = {}
    for key, value in kohya.items():
        name, _, suffix = key.partition(".")
        if suffix == "alpha":
            continue
        rank = kohya[f"{name}.lora_down.weight"].shape[0]
        scale = float(kohya[f"{name}.alpha"]) / rank
        path = {"lora_unet_" + layout.original_path(p).replace(".", "_"): layout.original_path(p)
                for p, _ in c.denoiser.named_modules()}[name]
        ai_toolkit[f"diffusion_model.{path}." + ("lora_A.weight" if "down" in suffix else "lora_B.weight")] = \
            value * (scale if "up" in suffix else 1.0)
    split = _convert_kohya_flux2_lora_to_diffusers(dict(kohya))
    assert any(k.startswith("transformer.transformer_blocks.0.attn.to_q.") for k in split)
    # the same with an alpha of 2 x rank per module (scale 2), its ups halved: each part's scale must be applied
    split_alpha = {k: v / 2 if ".lora_B." in k else v for k, v in split.items()}
    split_alpha.update({k.replace(".lora_A.weight", ".alpha"): torch.tensor(2.0 * v.shape[0])
                        for k, v in split.items() if k.endswith(".lora_A.weight")})
    text = family.encode_text(c, family.tokenize(c, ["a cat"], None), None)
    x = torch.randn(1, 32, 8, 8, generator=torch.Generator().manual_seed(4))

    def predict_with(state) -> torch.Tensor:
        model = family.load(LoadOptions("tiny:flux2", family_options=Flux2Options(qwen3_max_token_length=16)))
        path = str(tmp_path / "converted.safetensors")
        write_safetensors(family.convert_lora_state_dict(state), path)
        network, _ = create_network_from_weights(1.0, path, model.vae, model.text_encoders, model.denoiser,
                                                 lora_targets=family.lora_targets(model))
        network.apply_to(model.text_encoders, model.denoiser, apply_text_encoder=False, apply_unet=True)
        network.load_weights(path)
        with torch.no_grad():
            return family.predict(model, x, torch.tensor([500.0]), text, {})

    expected = predict_with(kohya)
    with torch.no_grad():
        base = family.predict(c, x, torch.tensor([500.0]), text, {})
    assert (expected - base).abs().max() > 1e-2
    for state in (ai_toolkit, split, split_alpha):
        torch.testing.assert_close(predict_with(state), expected, rtol=0, atol=1e-5)


def _deltas(kohya: dict) -> dict:
    """Each kohya module's weight change up @ down · alpha / rank."""
    names = {k.partition(".")[0] for k in kohya}
    return {n: kohya[f"{n}.lora_up.weight"] @ kohya[f"{n}.lora_down.weight"]
            * (float(kohya[f"{n}.alpha"]) / kohya[f"{n}.lora_down.weight"].shape[0]) for n in names}


def test_convert_lora_tool_writes_each_layout_of_a_flux2_file(tmp_path):
    """tools/convert_lora.py tells a FLUX.2 file from a FLUX.1 one (no metadata: by its single blocks' shapes):
    --to diffusers gives diffusers' own split names, which Flux2KleinPipeline.load_lora_weights places with nothing
    left over; --to ai-toolkit and --to comfy give BFL paths under diffusion_model. and both convert back to the
    kohya file's weight changes (ai-toolkit's scale folded into B, alpha = rank / 2 here: measured difference below
    1e-7; 1e-6 allowed); a
    text-encoder LoRA cannot go to the transformer-only layouts (one line, exit 2)."""
    from diffusers import Flux2KleinPipeline

    from library.core.safetensors_io import write_safetensors
    from library.families.flux2.loading import scheduler
    from library.families.flux2.lora_names import bfl_path
    from tests.train_helpers import largest_difference, random_lora_file
    from tools.convert_lora import main as convert

    family = get_family("flux2")
    c = family.load(LoadOptions("tiny:flux2", family_options=Flux2Options(qwen3_max_token_length=16)))
    full = random_lora_file(family, c, str(tmp_path / "full.safetensors"))
    kohya = {k: v for k, v in load_file(full).items() if k.startswith("lora_unet_")}
    src = str(tmp_path / "kohya.safetensors")
    write_safetensors(kohya, src)
    paths = {}
    for to in ("diffusers", "ai-toolkit", "comfy"):
        paths[to] = str(tmp_path / f"{to}.safetensors")
        assert convert(["--src_path", src, "--dst_path", paths[to], "--to", to]) == 0
    diffusers_state = load_file(paths["diffusers"])
    assert "transformer.transformer_blocks.0.attn.to_q.lora_A.weight" in diffusers_state
    assert "transformer.single_transformer_blocks.2.attn.to_qkv_mlp_proj.lora_B.weight" in diffusers_state
    pipe = Flux2KleinPipeline(scheduler=scheduler(), vae=c.vae, text_encoder=c.text_encoders[0],
                              tokenizer=c.tokenizers[0], transformer=c.denoiser)
    pipe.load_lora_weights(dict(diffusers_state))
    assert len([n for n, _ in c.denoiser.named_modules() if n.endswith(".lora_A")]) == 2 * 12 + 3 * 2
    names = {k.partition(".")[0] for k in kohya}
    assert set(load_file(paths["ai-toolkit"])) == {f"diffusion_model.{bfl_path(n)}.{s}" for n in names
                                                   for s in ("lora_A.weight", "lora_B.weight")}
    assert "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight" in load_file(paths["ai-toolkit"])
    assert "diffusion_model.double_blocks.1.txt_attn.qkv.alpha" in load_file(paths["comfy"])
    for to in ("ai-toolkit", "comfy"):
        back = str(tmp_path / f"back-{to}.safetensors")
        assert convert(["--src_path", paths[to], "--dst_path", back, "--to", "kohya"]) == 0
        assert largest_difference(_deltas(load_file(back)), _deltas(kohya)) <= 1e-6
    assert convert(["--src_path", full, "--dst_path", str(tmp_path / "no.safetensors"), "--to", "diffusers"]) == 2
    assert not os.path.exists(tmp_path / "no.safetensors")


def test_merge_tool_writes_the_merged_comfy_dit(tmp_path, flux2_files):
    """tools/merge_lora.py on ComfyUI's files (--qwen3 / --ae as training takes them): the saved DiT has the file's
    keys and each LoRA'd weight is the original plus up @ down · alpha / rank, computed here in BFL's layout (the
    fused qkv's up stacks the q, k, v slices over one down)."""
    from tools import merge_lora

    family = get_family("flux2")
    c = family.load(LoadOptions("tiny:flux2"))
    lora_path = random_lora_file(family, c, str(tmp_path / "lora.safetensors"))
    out = str(tmp_path / "merged.safetensors")
    assert merge_lora.main(["--sd_model", flux2_files["dit"], "--qwen3", flux2_files["qwen3"], "--ae",
                            flux2_files["ae"], "--models", lora_path, "--ratios", "1.0", "--save_to", out]) == 0
    modules = [f"double_blocks.{i}.{m}" for i in range(2) for m in (
        "img_attn.qkv", "img_attn.proj", "img_mlp.0", "img_mlp.2", "txt_attn.qkv", "txt_attn.proj", "txt_mlp.0",
        "txt_mlp.2")] + [f"single_blocks.{i}.{m}" for i in range(3) for m in ("linear1", "linear2")]
    assert len(modules) == 22
    assert_merged_in_original_layout(out, flux2_files["dit"], lora_path, modules)
