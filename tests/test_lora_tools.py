"""The LoRA tools end to end: files and metadata, resize, merge (LoRA+LoRA and into tiny:sd1), extract, show_metadata."""

import json
import os

import pytest
import torch
from safetensors import safe_open

from library.core import hashes
from library.families import get_family
from library.families.lora_convert import load_lora_file
from networks.lora_files import LoraModule, save_lora_file
from networks.lora_merge import WeightedLora, concat_merge, svd_merge

# SDXL-style names (SGM UNet blocks, two text encoders): the tools work by key pattern, not by model.
SDXL_MODULES = [("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q", 640, 640, None),
                ("lora_unet_output_blocks_2_0_in_layers_2", 1280, 2560, 3),
                ("lora_te1_text_model_encoder_layers_0_mlp_fc1", 3072, 768, None),
                ("lora_te2_text_model_encoder_layers_0_self_attn_q_proj", 1280, 1280, None)]


SMALL_MODULES = [("lora_unet_a", 96, 64, None), ("lora_unet_conv", 48, 32, 3), ("lora_te1_b", 128, 64, None)]


def _modules(rank=8, alpha=4.0, seed=0, spec=SDXL_MODULES):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, o, i, k in spec:
        if k:
            out[name] = LoraModule(name, torch.randn(rank, i, k, k, generator=g) * 0.1,
                                   torch.randn(o, rank, 1, 1, generator=g) * 0.1, alpha)
        else:
            out[name] = LoraModule(name, torch.randn(rank, i, generator=g) * 0.1, torch.randn(o, rank, generator=g) * 0.1,
                                   alpha)
    return out


def _write(path, modules, metadata=None):
    save_lora_file(str(path), modules.values(), metadata or {"ss_network_dim": "8", "ss_network_alpha": "4.0",
                                                             "ss_base_model_version": "sdxl_base_v1-0"})
    return str(path)


def _metadata(path):
    with safe_open(path, framework="pt") as f:
        return dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}


def _run(tool, argv):
    import importlib

    return importlib.import_module(f"tools.{tool}").main(argv)


def test_resize_tool_dynamic_updates_metadata_and_hashes(tmp_path, capsys):
    src = _write(tmp_path / "in.safetensors", _modules())
    out = str(tmp_path / "out.safetensors")
    assert _run("resize_lora", ["--model", src, "--save_to", out, "--new_rank", "4", "--dynamic_method", "sv_fro",
                                "--dynamic_param", "0.5", "--verbose", "--save_precision", "fp16"]) == 0
    printed = capsys.readouterr().out
    assert "lora_te1_text_model_encoder_layers_0_mlp_fc1: rank 8 -> " in printed and "fro retained:" in printed
    md, tensors = _metadata(out)
    assert md["ss_network_dim"] == "Dynamic" and md["ss_network_alpha"] == "Dynamic"
    assert md["ss_training_comment"] == "dynamic resize with sv_fro: 0.5 from 8"
    assert (md["sshs_model_hash"], md["sshs_legacy_hash"]) == hashes.sshs_hashes(tensors, md)
    assert all(v.dtype == torch.float16 for v in tensors.values())
    assert {k: tuple(v.shape) for k, v in tensors.items() if k.endswith("lora_down.weight")} == {
        # random rank-8 spectra keep ~20% of ‖ΔW‖² in σ0, so 0.5² is reached at index 1: 1 + 1 + 1 = 3
        "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight": (3, 640),
        "lora_unet_output_blocks_2_0_in_layers_2.lora_down.weight": (3, 2560, 3, 3),
        "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": (3, 768),
        "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight": (3, 1280)}


def test_resize_fixed_keeps_delta_of_kept_rank(tmp_path):
    """The resized alpha is written "4.0", as sd-scripts' resize_lora writes it (was "4")."""
    modules = _modules()
    src = _write(tmp_path / "in.safetensors", modules)
    out = str(tmp_path / "out.safetensors")
    assert _run("resize_lora", ["--model", src, "--save_to", out, "--new_rank", "8"]) == 0
    md, _ = _metadata(out)
    assert (md["ss_network_dim"], md["ss_network_alpha"], md["ss_training_comment"]) == (
        "8", "4.0", "Dimension resized from 8 to 8")
    resized = load_lora_file(out).modules
    for name, m in modules.items():
        assert float((resized[name].delta() - m.delta()).norm() / m.delta().norm()) < 1e-5


def test_tools_refuse_bad_input_with_one_line(tmp_path, capsys):
    from safetensors.torch import save_file

    bad = str(tmp_path / "loha.safetensors")
    save_file({"lora_unet_a.hada_w1_a": torch.zeros(2, 2)}, bad)
    assert _run("resize_lora", ["--model", bad, "--save_to", str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {bad}: lora_unet_a.hada_w1_b is missing (a LyCORIS LoHa module)\n"
    assert _run("merge_lora", ["--save_to", str(tmp_path / "o.safetensors"), "--models", bad]) == 2
    assert "give --concat (exact) or --new_rank" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o.safetensors")


def test_concat_merge_is_exact_and_svd_merge_refactors():
    a, b = _modules(seed=1, spec=SMALL_MODULES), _modules(rank=4, alpha=1.0, seed=2, spec=SMALL_MODULES)
    loras = [WeightedLora(a, 1.0), WeightedLora(b, -0.5)]
    expected = {n: a[n].delta() - 0.5 * b[n].delta() for n in a}
    concat = {m.name: m for m in concat_merge(loras)}
    assert {m.rank for m in concat.values()} == {12}
    assert all(float((concat[n].delta() - expected[n]).norm() / expected[n].norm()) < 1e-5 for n in a)
    full_rank = {m.name: m for m in svd_merge(loras, new_rank=12)}
    assert all(float((full_rank[n].delta() - expected[n]).norm() / expected[n].norm()) < 1e-4 for n in a)
    low = {m.name: m for m in svd_merge(loras, new_rank=3)}
    for n, m in low.items():  # the best rank-3 approximation (Eckart-Young), checked in float64
        target = expected[n].flatten(1).double()
        s = torch.linalg.svdvals(target)
        assert m.rank == 3 and m.alpha == 3.0
        error = float((m.delta().flatten(1).double() - target).norm())
        assert error == pytest.approx(float(s[3:].norm()), rel=1e-5)


def test_merge_tool_lora_plus_lora(tmp_path):
    a = _write(tmp_path / "a.safetensors", _modules(seed=1))
    b = _write(tmp_path / "b.safetensors", _modules(seed=2))
    out = str(tmp_path / "ab.safetensors")
    assert _run("svd_merge_lora", ["--models", a, b, "--ratios", "1", "0.5", "--new_rank", "6",
                                   "--save_to", out]) == 0
    md, _ = _metadata(out)
    assert (md["ss_network_dim"], md["ss_network_alpha"]) == ("6", "6")
    assert md["ss_training_comment"] == "merged (SVD to rank 6): a.safetensorsx1, b.safetensorsx0.5"


# --- with the tiny SD 1.x model -------------------------------------------------------------


@pytest.fixture
def tiny(tiny_sd1):
    """tiny:sd1 as tools.lora_models.load_model("tiny:sd1") returns it (the session's shared model)."""
    from tools.lora_models import LoadedModel

    return LoadedModel(get_family("sd"), tiny_sd1)


def _lora_for(layers, names, rank=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in names:
        w = layers[name].weight
        down = torch.randn(rank, *w.shape[1:], generator=g) * 0.3
        up = torch.randn(w.shape[0], rank, *((1, 1) if w.dim() == 4 else ()), generator=g) * 0.3
        out[name] = LoraModule(name, down, up, 1.0)
    return out


def _unet_out(components):
    g = torch.Generator().manual_seed(0)
    unet = components.denoiser
    x = torch.randn(1, unet.config.in_channels, 16, 16, generator=g)
    ctx = torch.randn(1, 5, unet.config.cross_attention_dim, generator=g)
    with torch.no_grad():
        return unet(x, torch.tensor([10]), ctx).sample


def test_merge_into_base_equals_running_the_lora(tiny, tmp_path):
    from networks.lora import create_network_from_weights
    from networks.lora_files import modules_state_dict
    from tools.lora_models import load_model, lora_layers

    layers = lora_layers(tiny)
    names = [n for n in layers if n.startswith("lora_unet")][::7]
    names.append(next(n for n in layers if layers[n].weight.dim() == 4 and layers[n].weight.shape[-1] == 3))
    modules = _lora_for(layers, names)
    c = tiny.components
    network, _ = create_network_from_weights(0.7, None, c.vae, c.text_encoders[0], c.denoiser,
                                             weights_sd=modules_state_dict(modules.values()),
                                             lora_targets=tiny.family.lora_targets(c))
    network.load_state_dict(modules_state_dict(modules.values()), strict=False)
    network.apply_to(c.text_encoders[0], c.denoiser)
    with_lora = _unet_out(c)
    network.restore()
    base = _unet_out(c)

    path = _write(tmp_path / "l.safetensors", modules)
    out = str(tmp_path / "merged.safetensors")
    assert _run("merge_lora", ["--sd_model", "tiny:sd1", "--save_to", out, "--models", path, "--ratios", "0.7"]) == 0
    merged = load_model(out)
    merged_out = _unet_out(merged.components)
    assert float((with_lora - base).abs().max()) > 1e-3  # the LoRA does something
    assert torch.allclose(merged_out, with_lora, atol=1e-4, rtol=1e-4)
    merged_layers = lora_layers(merged)
    untouched = next(n for n in layers if n not in modules)
    assert torch.equal(merged_layers[untouched].weight, layers[untouched].weight)


def test_extract_recovers_a_low_rank_difference(tiny):
    from networks.lora_extract import ExtractOptions, extract_lora
    from tools.lora_models import LoraLayer, lora_layers

    layers = lora_layers(tiny, include_conv=True)
    names = [n for n in layers if n.startswith("lora_unet")][::5]
    names.append(next(n for n in layers if layers[n].weight.dim() == 4 and layers[n].weight.shape[-1] == 3))
    truth = _lora_for(layers, names, rank=2, seed=3)
    tuned = {}
    for n, layer in layers.items():
        w = layer.weight.detach().clone()
        if n in truth:
            w += truth[n].delta()
        tuned[n] = LoraLayer(torch.nn.Linear(1, 1), layer.is_text_encoder)
        tuned[n].module.weight = torch.nn.Parameter(w)
    modules = extract_lora(layers, tuned, ExtractOptions(dim=4, conv_dim=4, clamp_quantile=1.0))
    by_name = {m.name: m for m in modules}
    assert not any(n.startswith("lora_te") for n in by_name)  # text encoder unchanged: left out
    assert len(by_name) == sum(1 for n in layers if n.startswith("lora_unet"))
    for n, m in truth.items():
        assert by_name[n].rank == 4 and by_name[n].alpha == 4.0
        assert float((by_name[n].delta() - m.delta()).norm() / m.delta().norm()) < 1e-4
    other = next(n for n in by_name if n not in truth)
    assert float(by_name[other].delta().abs().max()) < 1e-5
    clamped = extract_lora(layers, tuned, ExtractOptions(dim=4, conv_dim=4, clamp_quantile=0.5))
    m = next(x for x in clamped if x.name == names[0])
    assert float(m.up.abs().max()) <= float(torch.cat([m.up.flatten(), m.down.flatten()]).abs().max())


def test_show_metadata_prints_sorted_json_and_summary(tmp_path, capsys):
    path = _write(tmp_path / "a.safetensors", _modules(), {"ss_network_dim": "8", "ss_base_model_version": "sdxl_base_v1-0",
                                                           "ss_network_args": json.dumps({"conv_dim": "8"})})
    assert _run("show_metadata", [path, "--keys"]) == 0
    out = capsys.readouterr().out
    md_text = out[:out.index("}\n") + 2]
    md = json.loads(md_text)
    assert list(md) == sorted(md) and md["ss_network_args"] == {"conv_dim": "8"}
    summary = json.loads(out[out.rindex("\n{") + 1:])
    assert summary["modules"] == 4 and summary["ranks"] == [8] and summary["alphas"] == [4.0]
    assert summary["modules_by_part"] == {"lora_te1": 1, "lora_te2": 1, "lora_unet": 2}
    assert summary["conv_modules"] == 1
    assert "lora_unet_output_blocks_2_0_in_layers_2.lora_down.weight\t[8, 2560, 3, 3]\tfloat32" in out


def test_show_metadata_summarizes_a_lycoris_file(tmp_path, capsys):
    from safetensors.torch import save_file

    t = torch.zeros(2, 2)
    state = {"lycoris_transformer_blocks_0_attn_to_q.lokr_w1": t, "lycoris_transformer_blocks_0_attn_to_q.alpha": t[0, 0],
             "lycoris_transformer_blocks_0_attn_to_k.hada_w1_a": t, "lycoris_transformer_blocks_0_attn_to_k.alpha": t[0, 0],
             "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": t,
             "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": t}
    path = str(tmp_path / "lyco.safetensors")
    save_file({k: v.clone() for k, v in state.items()}, path, {"ss_network_module": "lycoris.kohya", "ss_base_model_version": "flux1"})
    assert _run("show_metadata", [path, "--keys"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.rindex("\n{") + 1:])
    assert summary == {"layout": "lycoris", "base_model_version": "flux1", "modules": 3,
                       "modules_by_part": {"lora_te1": 1, "lycoris": 2},
                       "algorithms": {"LoHa": 1, "LoKr": 1, "LoRA/LoCon": 1}, "dtype": "float32",
                       "network_module": "lycoris.kohya", "network_args": None}


QKV, LINEAR1, PROJ = ("lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_single_blocks_0_linear1",
                      "lora_unet_double_blocks_0_img_attn_proj")


def _flux_projections(model):
    t = model.components.denoiser
    double, single = t.transformer_blocks[0].attn, t.single_transformer_blocks[0]
    return {QKV: [double.to_q, double.to_k, double.to_v],
            LINEAR1: [single.attn.to_q, single.attn.to_k, single.attn.to_v, single.proj_mlp],
            PROJ: [double.to_out[0]]}


def test_flux_fused_modules_merge_like_the_trained_network(tiny_flux_copy):
    from networks.lora import create_network_from_weights
    from networks.lora_files import modules_state_dict
    from networks.lora_merge import merge_into_layers
    from tools.lora_models import LoadedModel, lora_layers

    flux = LoadedModel(get_family("flux"), tiny_flux_copy)  # merged into below
    layers, projections = lora_layers(flux), _flux_projections(flux)
    for name, members in projections.items():  # one layer per kohya name, members in slot order
        assert [id(m) for m in layers[name].members] == [id(m) for m in members]
        assert layers[name].weight.shape[0] == sum(m.weight.shape[0] for m in members)
    modules = _lora_for(layers, list(projections))
    c = flux.components
    network, _ = create_network_from_weights(0.5, None, c.vae, c.text_encoders, c.denoiser,
                                             weights_sd=modules_state_dict(modules.values()),
                                             lora_targets=flux.family.lora_targets(c))
    network.load_state_dict(modules_state_dict(modules.values()), strict=False)
    network.apply_to(c.text_encoders, c.denoiser)
    x = torch.randn(2, projections[QKV][0].in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with_lora = {n: [m(x) for m in ms] for n, ms in projections.items()}
    network.restore()

    assert merge_into_layers(layers, [WeightedLora(modules, 0.5)]) == 3
    with torch.no_grad():
        for name, members in projections.items():
            for merged, expected in zip([m(x) for m in members], with_lora[name]):
                torch.testing.assert_close(merged, expected, rtol=1e-4, atol=1e-5)


def test_flux_fused_modules_extract_the_stacked_difference(tiny_flux, tiny_flux_copy):
    from networks.lora_extract import ExtractOptions, extract_lora
    from tools.lora_models import LoadedModel, lora_layers

    family = get_family("flux")
    org, tuned = LoadedModel(family, tiny_flux), LoadedModel(family, tiny_flux_copy)  # tuned is changed below
    org_layers, tuned_layers = lora_layers(org), lora_layers(tuned)
    truth = _lora_for(org_layers, [QKV, LINEAR1, PROJ], seed=5)
    for name, module in truth.items():
        tuned_layers[name].set_weight(tuned_layers[name].weight + module.delta())
    rows = [m.weight.shape[0] for m in _flux_projections(tuned)[QKV]]
    torch.testing.assert_close(_flux_projections(tuned)[QKV][1].weight.detach(),
                               (org_layers[QKV].weight + truth[QKV].delta())[rows[0]:rows[0] + rows[1]])
    modules = {m.name: m for m in extract_lora(org_layers, tuned_layers, ExtractOptions(dim=2, clamp_quantile=1.0))}
    # every transformer layer, one module per fused name; the text encoders are unchanged and left out
    assert sorted(modules) == sorted(n for n in org_layers if n.startswith("lora_unet_"))
    for name, module in truth.items():
        assert modules[name].up.shape == (org_layers[name].weight.shape[0], 2)
        assert float((modules[name].delta() - module.delta()).norm() / module.delta().norm()) < 1e-4


def test_merge_lora_into_sdxl_file_without_model_family(tmp_path, tiny_sdxl, tiny_sdxl_file):
    """merge_lora.py --sd_model <SDXL single file> without --model_family merges with the family
    the file shows (it used to detect SDXL, then refuse it as an SD 1.x/2.x checkpoint)."""
    from tools.lora_models import LoadedModel, load_model, lora_layers

    layers = lora_layers(LoadedModel(get_family("sdxl"), tiny_sdxl))
    name = next(n for n in layers if n.startswith("lora_unet") and layers[n].weight.dim() == 2)
    path = _write(tmp_path / "l.safetensors", _lora_for(layers, [name]))
    out = str(tmp_path / "merged.safetensors")
    assert _run("merge_lora", ["--sd_model", tiny_sdxl_file, "--save_to", out, "--models", path]) == 0
    merged = load_model(out)  # detected again: an SDXL file
    assert merged.family.name == "sdxl"
    assert not torch.equal(lora_layers(merged)[name].weight, layers[name].weight)
