"""--network_module lycoris.kohya: every algorithm trains, saves kohya names, and loads back in LyCORIS."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from library.families import get_family
from library.train.adapters.network_setup import kohya_name_map
from tests.train_helpers import base_args, make_dataset, make_trainer

lycoris_kohya = pytest.importorskip("lycoris.kohya")

ALGOS = ["locon", "loha", "lokr", "dylora", "full", "ia3", "diag-oft", "boft"]


def unet_and_te_outputs(components):
    g = torch.Generator().manual_seed(0)
    unet, te = components.denoiser, components.text_encoders[0]
    x = torch.randn(1, 4, 8, 8, generator=g)
    ids = torch.randint(0, te.config.vocab_size - 2, (1, 77), generator=g)
    with torch.no_grad():
        hidden = te(ids).last_hidden_state
        return unet(x, torch.tensor([500]), hidden).sample, hidden


@pytest.mark.parametrize("algo", ALGOS)
def test_lycoris_algo_trains_saves_and_reloads(tmp_path, algo, tiny_sd1_copy):
    data = make_dataset(str(tmp_path), n=1)
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), steps=2, extra=[
        "--network_module", "lycoris.kohya", "--learning_rate", "1e-2",
        "--network_args", f"algo={algo}", "preset=attn-mlp"]))
    path = trainer.run()
    saved = load_file(path)
    assert all(k.startswith(("lora_unet_", "lora_te_text_model_")) for k in saved), sorted(saved)[:3]

    trainer.accelerator.unwrap_model(trainer.network).eval()
    trained_out, trained_hidden = unet_and_te_outputs(trainer.components)

    family = get_family("sd")
    fresh = tiny_sd1_copy  # the base model; the network is hooked into it below
    base_out, _ = unet_and_te_outputs(fresh)
    assert not torch.allclose(base_out, trained_out), "training changed nothing"
    if algo == "dylora":
        # LyCORIS saves DyLoRA as plain lora_down/lora_up/alpha (1x1-conv ups as 2-D) and cannot
        # load such a file back into a DyLoRA network, so the check stops at the saved layout.
        assert {k.split(".", 1)[1] for k in saved} == {"lora_down.weight", "lora_up.weight", "alpha"}
        return
    # LyCORIS names modules by raw paths; undo the kohya renaming for it. The network is rebuilt
    # with the same arguments and loaded strictly (LyCORIS 4.1's from-weights path cannot rebuild
    # ia3, full or dylora networks).
    back = {v: k for k, v in kohya_name_map(family.lora_targets(fresh)).items()}
    weights = {back.get(k.split(".", 1)[0], k.split(".", 1)[0]) + "." + k.split(".", 1)[1]: v
               for k, v in saved.items()}
    network = lycoris_kohya.create_network(1.0, 4, 4, fresh.vae, fresh.text_encoders[0], fresh.denoiser,
                                           algo=algo, preset="attn-mlp")
    network.apply_to(fresh.text_encoders[0], fresh.denoiser, True, True)
    missing, unexpected = network.load_state_dict(weights, strict=False)
    assert not unexpected and not [k for k in missing if not k.endswith("org_weight")], (missing, unexpected)
    network.eval()
    reloaded_out, reloaded_hidden = unet_and_te_outputs(fresh)
    torch.testing.assert_close(reloaded_hidden, trained_hidden, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(reloaded_out, trained_out, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("algo, parts", [
    ("locon", ["alpha", "lora_down.weight", "lora_up.weight"]),
    ("lokr", ["alpha", "lokr_w1", "lokr_w2", "lokr_w2_a", "lokr_w2_b"]),
])
def test_lycoris_on_sdxl_saves_sgm_kohya_names(tmp_path, algo, parts):
    from collections import Counter

    from networks.lora_args import sdxl_unet_block_index

    data = make_dataset(str(tmp_path), n=1)
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), preset="tiny:sdxl", steps=2, extra=[
        "--network_module", "lycoris.kohya", "--network_train_unet_only", "--bucket_reso_steps", "32",
        "--network_args", f"algo={algo}", "preset=attn-mlp"]), "sdxl")
    saved = load_file(trainer.run())
    modules = sorted({k.split(".", 1)[0] for k in saved})
    sgm_block = re.compile(r"^lora_unet_(input_blocks|middle_block|output_blocks|label_emb|time_embed)_\d")
    groups = Counter(sgm_block.match(m).group(1) if sgm_block.match(m) else m for m in modules)
    assert groups == {"input_blocks": 248, "middle_block": 102, "output_blocks": 372, "label_emb": 2, "time_embed": 2}
    assert all(sdxl_unet_block_index(m) >= 0 for m in modules)  # every name is in the SGM layout
    for name in ("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q",
                 "lora_unet_middle_block_1_transformer_blocks_0_attn2_to_k",
                 "lora_unet_output_blocks_5_1_transformer_blocks_1_ff_net_2",
                 "lora_unet_label_emb_0_0", "lora_unet_time_embed_2"):
        assert name in modules
    assert sorted({k.split(".", 1)[1] for k in saved}) == parts


def test_lycoris_network_weights_continue_training_from_a_saved_file(tmp_path):
    """--network_weights with lycoris.kohya: every saved tensor (kohya names, text encoder included) is loaded."""
    data = make_dataset(str(tmp_path), n=1)
    extra = ["--network_module", "lycoris.kohya", "--learning_rate", "1e-2", "--network_args", "algo=locon",
             "preset=attn-mlp"]
    first = make_trainer(base_args(data, str(tmp_path / "a"), steps=2, extra=extra)).run()
    saved = load_file(first)
    assert any(k.startswith("lora_te_text_model_") for k in saved)
    second = make_trainer(base_args(data, str(tmp_path / "b"), steps=1, extra=[
        *extra, "--network_weights", first, "--learning_rate", "1e-12"]))
    again = load_file(second.run())  # a negligible learning rate: the file's weights come out as loaded
    assert again.keys() == saved.keys()
    for k in saved:
        torch.testing.assert_close(again[k].float(), saved[k].float(), rtol=0, atol=1e-8, msg=k)


@pytest.mark.parametrize("algo", ["locon", "loha"])
def test_lycoris_on_an_fp8_base_runs_in_bypass_mode(tmp_path, algo):
    """LyCORIS' default forward adds ΔW to the base weight, which float8 cannot; bypass mode adds outputs."""
    data = make_dataset(str(tmp_path), n=1)
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), steps=3, extra=[
        "--network_module", "lycoris.kohya", "--learning_rate", "1e-2", "--fp8_base",
        "--network_args", f"algo={algo}", "preset=attn-mlp"]))
    path = trainer.run()  # the second step is the first with a non-zero adapter
    saved = load_file(path)
    assert all(m.bypass_mode for m in trainer.accelerator.unwrap_model(trainer.network).loras)
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "up" in k or "w2" in k)


def test_lycoris_network_weights_that_fit_nothing_stop_with_one_line(tmp_path, capsys):
    from safetensors.torch import save_file

    from library.cli.entry import run_training

    data = make_dataset(str(tmp_path), n=1)
    foreign = str(tmp_path / "foreign.safetensors")
    save_file({"lora_unet_nowhere.lora_down.weight": torch.zeros(4, 8),
               "lora_unet_nowhere.lora_up.weight": torch.zeros(8, 4)}, foreign)
    argv = base_args(data, str(tmp_path / "out"), steps=1, extra=[
        "--network_module", "lycoris.kohya", "--network_args", "algo=locon", "--network_weights", foreign])
    assert run_training("sd", "test", argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --network_weights {foreign}: none of its 2 tensors fits this network "
        "(e.g. lora_unet_nowhere.lora_down.weight); was it trained with other --network_args or another model?")


@pytest.mark.parametrize("family_name, preset, names", [
    ("sd", "tiny:sd1", ["lora_unet_time_embedding_linear_1", "lora_unet_time_embedding_linear_2"]),
    ("sdxl", "tiny:sdxl", ["lora_unet_time_embed_0", "lora_unet_time_embed_2"]),  # SGM names
])
def test_lycoris_default_full_preset_wraps_the_time_embedding_once(tmp_path, family_name, preset, names):
    """LyCORIS' "full" preset names TimestepEmbedding and its layers; each layer gets one module."""
    data = make_dataset(str(tmp_path), n=1)
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), preset, steps=1, extra=[
        "--network_module", "lycoris.kohya", "--network_args", "algo=locon"]), family_name)
    saved = load_file(trainer.run())
    time_modules = sorted({k.split(".")[0] for k in saved if "time_embed" in k})
    assert time_modules == names


def test_generation_applies_every_module_of_a_lycoris_file(tmp_path, tiny_sd1_copy):
    """tools/generate and sampling from a file: kohya-renamed keys (text_model, SGM) find their modules again."""
    from library.train.adapters.network_apply import NetworkSpec, apply_networks

    data = make_dataset(str(tmp_path), n=1)
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), steps=2, extra=[
        "--network_module", "lycoris.kohya", "--learning_rate", "1e-2", "--network_args", "algo=loha",
        "preset=attn-mlp"]))
    path = trainer.run()
    trainer.accelerator.unwrap_model(trainer.network).eval()
    trained = unet_and_te_outputs(trainer.components)
    family = get_family("sd")
    fresh = tiny_sd1_copy  # the base model; the network is hooked into it below
    applied = apply_networks(family, fresh, [NetworkSpec("lycoris.kohya", path, 1.0)], False, torch.device("cpu"),
                             torch.float32)
    network = applied.networks[0]
    assert len(network.unet_loras) + len(network.text_encoder_loras) == len({k.split(".")[0] for k in load_file(path)})
    for got, want in zip(unet_and_te_outputs(fresh), trained):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
