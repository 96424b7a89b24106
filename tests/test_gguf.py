"""GGUF base files (library/families/common/gguf_file.py): a ComfyUI-GGUF FLUX.1 (Z-Image, Qwen-Image) transformer
loads with its weights kept quantized (diffusers' GGUFParameter in GgufLinear layers), computes close to the
full-precision model, and a LoRA trains on it close to the full-precision one, saved in the same format."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from library.cli.memory import memory_options_from_args
from library.core.errors import ConfigError
from library.families import get_family
from library.families.base import LoadOptions, ModelLoadError
from library.families.common.gguf_file import (
    adopt_gguf,
    is_gguf,
    is_quantized,
    logical_shape,
    read_gguf,
    write_gguf,
)
from library.families.flux.configs import PRESETS, transformer_config
from library.families.flux.layout import infer_transformer_config
from library.families.flux.loading import block_counts, flux_source_kind
from library.families.flux.options import FluxOptions
from library.train.memory.quantize import quantized_layers, resident_bytes
from tests.train_helpers import base_args, make_dataset, make_trainer

pytest.importorskip("gguf")

FLUX_ARGS = ["--t5xxl_max_token_length", "16", "--network_train_unet_only", "--cache_text_encoder_outputs",
             "--gradient_checkpointing", "--guidance_scale", "1.0"]
# tiny:flux's transformer in the BFL layout: 29 2-D block weights quantized, 63 tensors F32 (1-D ones and the
# embedder / final-layer weights, as city96's convert.py keeps them)
QUANTIZED_TENSORS, F32_TENSORS = 29, 63
# after the fused qkv / linear1 are split: 46 of the 56 Linear layers hold GGUF weights (the other 10 are the
# embedders and the final layer, F32 in the file)
GGUF_LAYERS = 46


@pytest.fixture(scope="module")
def ggufs(tiny_flux_files, tmp_path_factory):
    """tiny:flux's BFL transformer written as ComfyUI-GGUF files: {"Q8_0": path, "Q4_0": path, "Q8_0-all": path}
    ("-all": every 2-D weight quantized, the embedders too)."""
    root = tmp_path_factory.mktemp("gguf")
    sd = load_file(tiny_flux_files["transformer"])
    out = {}
    for qtype in ("Q8_0", "Q4_0"):
        out[qtype] = str(root / f"flux1-tiny-{qtype}.gguf")
        types = Counter(write_gguf(out[qtype], sd, qtype, "flux").values())
        assert types == {qtype: QUANTIZED_TENSORS, "F32": F32_TENSORS}
    out["Q8_0-all"] = str(root / "flux1-tiny-Q8_0-all.gguf")
    assert Counter(write_gguf(out["Q8_0-all"], sd, "Q8_0", "flux", full_precision=()).values()) == {
        "Q8_0": QUANTIZED_TENSORS + 10, "F32": F32_TENSORS - 10}
    return out


def _flags(files):
    return {flag: files[flag] for flag in ("clip_l", "t5xxl", "ae")}


def _load(path, files, dtype=torch.float32):
    family = get_family("flux")
    return family.load(LoadOptions(path, dtype=dtype, family_options=FluxOptions(**_flags(files)))).denoiser


def _run(model):
    """The transformer's output on fixed inputs (16 image, 8 text tokens)."""
    g = torch.Generator().manual_seed(0)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    args = [torch.randn(1, 16, 64, generator=g), torch.randn(1, 8, 32, generator=g), torch.randn(1, 32, generator=g)]
    with torch.no_grad():
        return model(*(a.to(dtype) for a in args), torch.tensor([0.5]), torch.zeros(16, 3), torch.zeros(8, 3),
                     torch.tensor([1.0])).sample.float()


# ---------------------------------------------------------------------------- reading and the config
def test_detected_by_extension_and_magic(ggufs, tmp_path, tiny_flux_files):
    assert is_gguf(ggufs["Q8_0"]) and not is_gguf(tiny_flux_files["transformer"])
    renamed = tmp_path / "model.bin"
    renamed.write_bytes(open(ggufs["Q8_0"], "rb").read(64))
    assert is_gguf(str(renamed)) and flux_source_kind(str(renamed)) == "single_file"
    assert flux_source_kind(ggufs["Q8_0"]) == "single_file"
    assert block_counts(ggufs["Q8_0"]) == (2, 3)


def test_config_is_inferred_from_logical_shapes(ggufs):
    """With the embedders quantized too, their byte shapes would give wrong widths (img_in: 68 bytes per row of
    64 inputs in Q8_0); the logical shapes give the preset's config."""
    tensors = read_gguf("--pretrained_model_name_or_path", ggufs["Q8_0-all"], "FLUX.1", lambda keys: True,
                        torch.float32, archs=("flux",))
    img_in = tensors["img_in.weight"]
    assert is_quantized(img_in) and tuple(img_in.shape) == (32, 68) and logical_shape(img_in) == (32, 64)
    config = infer_transformer_config(tensors)
    assert config == {k: v for k, v in transformer_config(PRESETS["tiny:flux"]).items()}


# ‖GGUF − fp32‖ / ‖fp32‖ of tiny:flux's transformer output, measured: Q8_0 6.9e-4, Q4_0 9.7e-3, Q8_0 with the
# embedders quantized too 5.9e-3. A quantized layer read with its halves of the fused qkv misplaced gives ~1.0, a
# dropped bias 0.1+.
FORWARD_TOLERANCE = {"Q8_0": 2e-3, "Q4_0": 3e-2, "Q8_0-all": 1.5e-2}


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q8_0-all"])
def test_quantized_forward_is_close_to_full_precision(ggufs, tiny_flux_files, kind):
    ref = _load(tiny_flux_files["transformer"], tiny_flux_files)
    model = _load(ggufs[kind], tiny_flux_files)
    layers = [m for m in model.modules() if type(m).__name__ == "GgufLinear"]
    assert len(layers) == GGUF_LAYERS + (10 if kind == "Q8_0-all" else 0)
    assert all(isinstance(m, nn.Linear) and is_quantized(m.weight) and m.weight.dtype == torch.uint8 for m in layers)
    assert quantized_layers([model]) == len(layers)
    assert {k for k, _ in model.named_parameters()} == {k for k, _ in ref.named_parameters()}
    # the GGUF layers' weights hold their blocks, views of the file: Q8_0 34 bytes per 32 weights, Q4_0 18
    weights = [m.weight for m in layers]
    ratio = resident_bytes(nn.ParameterList(weights)) / sum(4 * torch.Size(logical_shape(w)).numel() for w in weights)
    assert ratio == pytest.approx((34 if kind.startswith("Q8") else 18) / 32 / 4)
    a, b = _run(ref), _run(model)
    rel = ((a - b).norm() / a.norm()).item()
    print(f"{kind}: relative output error {rel:.3g}, resident {ratio:.3f} x fp32")
    assert rel <= FORWARD_TOLERANCE[kind]


def test_bf16_training_dtype(ggufs, tiny_flux_files):
    """Loaded in bf16, the plain tensors are bf16 and the GGUF layers compute in the input's dtype."""
    model = _load(ggufs["Q8_0"], tiny_flux_files, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16, torch.uint8}
    ref = _run(_load(tiny_flux_files["transformer"], tiny_flux_files))
    rel = ((_run(model) - ref).norm() / ref.norm()).item()
    assert rel < 0.03, rel  # measured 9.6e-3 (bf16 rounding of the activations dominates)


def test_backward_keeps_only_the_quantized_weight():
    """A GgufLinear keeps its Q8_0 bytes for backward, not a dequantized float copy (that would hold the whole
    model in full precision from forward to backward without checkpointing); output and input gradient are
    bitwise those of nn.Linear on the dequantized weight (the same ops)."""
    import gguf
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

    from library.families.common.gguf_file import gguf_linear_class

    torch.manual_seed(0)
    blocks = torch.from_numpy(gguf.quants.quantize(torch.randn(256, 128).numpy(), gguf.GGMLQuantizationType.Q8_0))
    layer = gguf_linear_class()(128, 256, True, compute_dtype=torch.float32)
    layer.weight = GGUFParameter(blocks, quant_type=gguf.GGMLQuantizationType.Q8_0)
    layer.bias = nn.Parameter(torch.randn(256), requires_grad=False)
    plain = nn.Linear(128, 256).requires_grad_(False)
    plain.weight.copy_(dequantize_gguf_tensor(layer.weight).float())
    plain.bias.copy_(layer.bias)
    x = torch.randn(4, 7, 128, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, t.numel())) or t, lambda t: t):
        y = layer(x)
    assert saved == [(torch.uint8, 256 * 128 // 32 * 34)]
    y.square().sum().backward()
    y2 = plain(x2)
    y2.square().sum().backward()
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_are_read_with_their_logical_shape(tmp_path, qtype):
    """K-quant tensors (what most ComfyUI-GGUF files hold: Q4_K_S, Q5_K_M, ...; gguf-py cannot write them, so the
    blocks here are random bytes with finite fp16 scales): read as GGUFParameter with the logical shape from the
    256-weight super-blocks, and a GgufLinear computes exactly linear() on diffusers' dequantization."""
    import gguf
    import numpy as np
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    from library.families.common.gguf_file import gguf_linear_class

    kind = getattr(gguf.GGMLQuantizationType, qtype)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(8, 512 // block * size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    for b in range(512 // block):  # every fp16 scale of the block finite: d (and dmin) at their offsets
        at = b * size + {"Q4_K": 0, "Q5_K": 0, "Q6_K": size - 2}[qtype]
        data[:, at:at + 2] = scale
        if qtype != "Q6_K":
            data[:, at + 2:at + 4] = scale
    path = str(tmp_path / f"{qtype}.gguf")
    writer = gguf.GGUFWriter(path, arch="flux")
    writer.add_tensor("w", data, raw_dtype=kind)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    weight = read_gguf("x", path, "w", lambda keys: True, torch.float32, archs=("flux",))["w"]
    assert is_quantized(weight) and weight.quant_type == kind and logical_shape(weight) == (8, 512)
    layer = gguf_linear_class()(512, 8, False, compute_dtype=torch.float32)
    layer.weight = weight
    x = torch.randn(3, 512)
    dense = dequantize_gguf_tensor(weight).float()
    assert torch.isfinite(dense).all() and dense.abs().max() > 0
    assert torch.equal(layer(x), nn.functional.linear(x, dense))


# ---------------------------------------------------------------------------- refusals, one line each
def test_unsupported_type_and_wrong_architecture_are_named_before_loading(ggufs, tmp_path, tiny_flux_files):
    import gguf
    import numpy as np

    sd = load_file(tiny_flux_files["transformer"])
    path = str(tmp_path / "int8.gguf")
    writer = gguf.GGUFWriter(path, arch="flux")
    for key, tensor in sd.items():
        writer.add_tensor(key, tensor.float().numpy())
    writer.add_tensor("extra.int8", np.zeros((4, 4), dtype=np.int8))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(ModelLoadError) as e:
        _load(path, tiny_flux_files)
    assert str(e.value).startswith(f"--pretrained_model_name_or_path {path}: GGUF tensor type I8 is not supported "
                                   "(diffusers dequantizes F32, F16, ")
    sd3 = str(tmp_path / "sd3.gguf")
    write_gguf(sd3, {"joint_blocks.0.x.weight": torch.zeros(32, 32)}, "Q8_0", "sd3")
    with pytest.raises(ModelLoadError) as e:
        _load(sd3, tiny_flux_files)
    assert str(e.value) == (f"--pretrained_model_name_or_path {sd3}: a GGUF file of architecture 'sd3'; expected a "
                            "FLUX.1 transformer in the BFL layout (double_blocks.* keys) (general.architecture 'flux')")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError) as e:
        _load(str(fake), tiny_flux_files)
    assert str(e.value) == (f"--pretrained_model_name_or_path {fake}: not a GGUF file (it does not start with the "
                            "GGUF magic)")


def test_flags_a_gguf_base_rules_out(ggufs):
    flux = get_family("flux")
    path = ggufs["Q8_0"]
    base = {"pretrained_model_name_or_path": path}
    assert memory_options_from_args(base, flux).base_model_precision == "no_change"
    assert memory_options_from_args({**base, "blocks_to_swap": 1}, flux).blocks_to_swap == 1
    cases = [
        ({"base_model_precision": "int8-quanto"}, False,
         f"--base_model_precision int8-quanto: {path} is a GGUF file, already quantized; drop the flag"),
        ({}, True, f"--pretrained_model_name_or_path {path}: a GGUF file holds quantized weights, which a full "
                   "fine-tune cannot train; use a LoRA script (*_train_network.py) or the .safetensors model"),
        ({"fp8_base": True}, False, f"--fp8_base with {path}: a GGUF file is already quantized; drop --fp8_base"),
        ({"base_weights": ["other.safetensors"]}, False,
         f"--base_weights with {path}: a GGUF file's weights stay quantized, nothing can be merged into them; merge "
         "into the .safetensors model first, or drop --base_weights"),
    ]
    for values, fine_tune, message in cases:
        with pytest.raises(ConfigError) as e:
            memory_options_from_args({**base, **values}, flux, fine_tune)
        assert str(e.value) == message


def test_full_fine_tune_script_refuses_a_gguf_base(ggufs, tiny_flux_files, tmp_path):
    import subprocess
    import sys

    flags = [a for flag, path in _flags(tiny_flux_files).items() for a in (f"--{flag}", path)]
    out = subprocess.run([sys.executable, "flux_train.py", "--pretrained_model_name_or_path", ggufs["Q8_0"], *flags,
                          "--train_data_dir", str(tmp_path), "--output_dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: --pretrained_model_name_or_path {ggufs['Q8_0']}: a GGUF file holds quantized weights, which a full "
        "fine-tune cannot train; use a LoRA script (*_train_network.py) or the .safetensors model")


def test_fsdp_refuses_a_gguf_base():
    from types import SimpleNamespace

    from library.train.distributed.sharding import FsdpSettings, fsdp_unsupported
    from library.train.settings import MemoryOptions

    s = SimpleNamespace(training=SimpleNamespace(compile=SimpleNamespace(torch_compile=False)), fine_tune=None,
                        network_kind=SimpleNamespace(own=True), network=SimpleNamespace(scale_weight_norms=None),
                        ema=SimpleNamespace(use_ema=False), memory=MemoryOptions(),
                        model=SimpleNamespace(pretrained_model_name_or_path="flux1-dev-Q8_0.gguf"))
    assert fsdp_unsupported(s, FsdpSettings(version=2)) == (
        "--pretrained_model_name_or_path flux1-dev-Q8_0.gguf: a GGUF file's quantized weights are not sharded; use a "
        "DDP config")
    s.model.pretrained_model_name_or_path = "flux1-dev.safetensors"
    assert fsdp_unsupported(s, FsdpSettings(version=2)) is None


def test_missing_gguf_package_is_named(ggufs, monkeypatch, tiny_flux_files):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    path = ggufs["Q8_0"]
    with pytest.raises(ConfigError) as e:
        memory_options_from_args({"pretrained_model_name_or_path": path}, get_family("flux"))
    assert str(e.value) == (f"--pretrained_model_name_or_path {path}: reading a GGUF file needs the gguf package, "
                            "which is not installed (pip install gguf)")
    with pytest.raises(ModelLoadError) as e:
        _load(path, tiny_flux_files)
    assert str(e.value) == (f"--pretrained_model_name_or_path {path}: reading a GGUF file needs the gguf package, "
                            "which is not installed (pip install gguf)")


def test_adopt_checks_logical_shapes(ggufs):
    tensors = read_gguf("x", ggufs["Q8_0"], "FLUX.1", lambda keys: True, torch.float32, archs=("flux",))
    from library.families.flux.layout import bfl_to_diffusers
    from diffusers import FluxTransformer2DModel

    sd = bfl_to_diffusers(tensors)
    config = transformer_config(PRESETS["tiny:flux"])
    with pytest.raises(ModelLoadError) as e:
        adopt_gguf("x", "f.gguf", lambda: FluxTransformer2DModel(**{**config, "joint_attention_dim": 64}), sd)
    assert str(e.value) == ("x f.gguf: context_embedder.weight has shape (32, 32), expected (32, 64) for the shapes "
                            "of the rest of the file")


# ---------------------------------------------------------------------------- training tiny:flux from the .gguf
def _train(tmp_path, name, model, files, extra=(), steps=3):
    data = make_dataset(str(tmp_path / "data"), n=2)
    flags = [a for flag, path in _flags(files).items() for a in (f"--{flag}", path)]
    trainer = make_trainer(base_args(data, str(tmp_path / name), model, steps=steps,
                                     extra=FLUX_ARGS + flags + list(extra)), "flux")
    losses = []
    step = trainer._micro_step
    trainer._micro_step = lambda *a: losses.append(step(*a)) or losses[-1]
    return losses, load_file(trainer.run()), trainer


def _delta_weights(lora):
    stems = [k[:-len("lora_down.weight")] for k in lora if k.endswith("lora_down.weight")]
    return {s: lora[s + "lora_up.weight"].float() @ lora[s + "lora_down.weight"].float() for s in stems}


def _relative_difference(a, b):
    da, db = _delta_weights(a), _delta_weights(b)
    num = sum(((da[k] - db[k]) ** 2).sum() for k in db) ** 0.5
    return (num / sum((db[k] ** 2).sum() for k in db) ** 0.5).item()


def test_lora_on_a_gguf_base_is_close_to_full_precision(ggufs, tiny_flux_files, tmp_path):
    """flux_train_network.py from the Q8_0 .gguf (gradient checkpointing, sampling during training) against the
    .safetensors file: the same LoRA keys and dtypes, finite, relative ‖ΔW − ΔW_full‖ / ‖ΔW_full‖ small."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("sks toy --w 64 --h 64 --s 2 --d 1\n")
    sample = ["--sample_prompts", str(prompts), "--sample_every_n_steps", "3"]
    full_losses, full, _ = _train(tmp_path, "full", tiny_flux_files["transformer"], tiny_flux_files)
    losses, lora, trainer = _train(tmp_path, "gguf", ggufs["Q8_0"], tiny_flux_files, sample)
    assert lora.keys() == full.keys() and all(lora[k].dtype == full[k].dtype for k in lora)
    assert all(torch.isfinite(v).all() for v in lora.values())
    assert quantized_layers([trainer.components.denoiser]) == GGUF_LAYERS
    samples = [f for f in os.listdir(tmp_path / "gguf" / "sample") if f.startswith("lora_000003_00_")]
    assert len(samples) == 1, samples  # the sample at step 3 ran through the GGUF layers
    rel = _relative_difference(lora, full)
    print(f"Q8_0: relative ΔW difference {rel:.3g}, losses {losses} vs {full_losses}")
    assert rel <= GGUF_LORA_TOLERANCE
    assert abs(losses[0] - full_losses[0]) <= 1e-3 * full_losses[0]


# relative ΔW difference after 3 steps, measured: Q8_0 vs the fp32 .safetensors file 0.033 (int8-quanto's is
# 0.059 in tests/test_quantize.py; another --seed in full precision gives 1.39)
GGUF_LORA_TOLERANCE = 0.1


def test_lora_with_block_swap_on_a_gguf_base(ggufs, tiny_flux_files, tmp_path):
    """--blocks_to_swap moves the GGUF blocks (real copies on the CPU): bitwise the LoRA trained without."""
    _, plain, _ = _train(tmp_path, "plain", ggufs["Q8_0"], tiny_flux_files, steps=2)
    _, swapped, trainer = _train(tmp_path, "swapped", ggufs["Q8_0"], tiny_flux_files, ["--blocks_to_swap", "1"],
                                 steps=2)
    assert trainer.block_swapper is not None and trainer.block_swapper.stats.loads > 0
    assert quantized_layers(trainer.block_swapper.swapped) > 0
    assert quantized_layers([trainer.components.denoiser]) == GGUF_LAYERS
    assert swapped.keys() == plain.keys()
    assert all(torch.equal(swapped[k], plain[k]) for k in plain)


# ---------------------------------------------------------------------------- Z-Image (general.architecture lumina2)
@pytest.fixture(scope="module")
def zimage_ggufs(tmp_path_factory):
    """tiny:zimage's DiT in the original (ComfyUI) names and as Q8_0 / Q4_0 ComfyUI-GGUF files."""
    from library.families.zimage.loading import write_zimage_preset

    paths = write_zimage_preset("tiny:zimage", str(tmp_path_factory.mktemp("zimage-gguf")))
    sd = load_file(paths["dit"])
    for qtype in ("Q8_0", "Q4_0"):
        paths[qtype] = paths["dit"][:-len(".safetensors")] + f"-{qtype}.gguf"
        # 34 2-D weights quantized; 1-D tensors, the 170-wide w2 (not a multiple of 32) and the embedders F32
        assert Counter(write_gguf(paths[qtype], sd, qtype, "lumina2").values()) == {qtype: 34, "F32": 55}
    return paths


# ‖GGUF − fp32‖ / ‖fp32‖ of tiny:zimage's DiT output, measured: Q8_0 7.0e-3, Q4_0 0.138 (every 2-D weight is
# quantized here, the embedders and AdaLN too; Q4_0's weights are 6.5% off on average). That the gap is only the
# quantization is checked exactly: the fp32 model given the dequantized weights computes the same output.
ZIMAGE_TOLERANCE = {"Q8_0": 0.015, "Q4_0": 0.2}


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_zimage_gguf_loads_quantized_and_computes_close(zimage_ggufs, kind):
    from library.families.zimage.loading import block_count, load_dit_file, zimage_source_kind

    assert zimage_source_kind(zimage_ggufs[kind]) == "single_file" and block_count(zimage_ggufs[kind]) == 2
    ref = load_dit_file(zimage_ggufs["dit"], torch.float32)
    model = load_dit_file(zimage_ggufs[kind], torch.float32)
    layers = [m for m in model.modules() if type(m).__name__ == "GgufLinear"]
    assert len(layers) == 44 and quantized_layers([model]) == 44  # qkv split into q, k, v
    assert {k for k, _ in model.named_parameters()} == {k for k, _ in ref.named_parameters()}
    g = torch.Generator().manual_seed(0)
    x = [torch.randn(16, 1, 8, 8, generator=g) for _ in range(2)]
    caps = [torch.randn(5, 32, generator=g), torch.randn(7, 32, generator=g)]
    with torch.no_grad():
        a = torch.stack(ref(x, torch.tensor([0.7, 0.2]), caps, return_dict=False)[0])
        b = torch.stack(model(x, torch.tensor([0.7, 0.2]), caps, return_dict=False)[0])
    rel = ((a - b).norm() / a.norm()).item()
    print(f"Z-Image {kind}: relative output error {rel:.3g}")
    assert rel <= ZIMAGE_TOLERANCE[kind]
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    state = {k: (dequantize_gguf_tensor(v).float() if is_quantized(v) else v) for k, v in model.state_dict().items()}
    ref.load_state_dict(state)
    with torch.no_grad():
        c = torch.stack(ref(x, torch.tensor([0.7, 0.2]), caps, return_dict=False)[0])
    assert torch.equal(b, c)  # the same ops on the same values


def test_zimage_refuses_a_flux_gguf(ggufs):
    from library.families.zimage.loading import load_dit_file

    with pytest.raises(ModelLoadError) as e:
        load_dit_file(ggufs["Q8_0"], torch.float32)
    assert str(e.value) == (f"--pretrained_model_name_or_path {ggufs['Q8_0']}: a GGUF file of architecture 'flux'; "
                            "expected a Z-Image DiT (layers.*.attention.qkv keys) (general.architecture 'lumina2')")


def test_zimage_lora_on_a_gguf_base(zimage_ggufs, tmp_path):
    """zimage_train_network.py (networks.lora_zimage: q, k, v of each block under one fused qkv LoRA) from the Q8_0
    .gguf against the .safetensors DiT: the same keys and dtypes, finite, close."""
    data = make_dataset(str(tmp_path / "data"), n=2)

    def train(name, model):
        trainer = make_trainer(base_args(data, str(tmp_path / name), model, steps=3, extra=[
            "--network_module", "networks.lora_zimage", "--qwen3_max_token_length", "32",
            "--cache_text_encoder_outputs", "--cache_latents", "--network_train_unet_only", "--gradient_checkpointing",
            "--qwen3", zimage_ggufs["qwen3"], "--ae", zimage_ggufs["ae"]]), "zimage")
        return load_file(trainer.run()), trainer

    full, _ = train("full", zimage_ggufs["dit"])
    lora, trainer = train("gguf", zimage_ggufs["Q8_0"])
    assert quantized_layers([trainer.components.denoiser]) == 44
    assert lora.keys() == full.keys() and all(lora[k].dtype == full[k].dtype for k in lora)
    assert all(torch.isfinite(v).all() for v in lora.values())
    rel = _relative_difference(lora, full)
    print(f"Z-Image Q8_0: relative ΔW difference {rel:.3g}")
    assert rel <= 0.25  # measured 0.082; another --seed in full precision gives 1.40


# ---------------------------------------------------------------------- Qwen-Image (general.architecture qwen_image)
# city96's Qwen-Image files (and QuantStack's Qwen-Image-Edit ones: the same DiT) hold the diffusers names
# (`transformer_blocks.0.img_mod.1.weight`) under general.architecture "qwen_image" (ComfyUI-GGUF's IMG_ARCH_LIST)
@pytest.fixture(scope="module")
def qwen_ggufs(tmp_path_factory):
    """tiny:qwen_image's split files (DiT .safetensors, text encoder, VAE) and the DiT as ComfyUI-GGUF files:
    Q8_0, Q4_0 and "Q8_0-all" (the embedders quantized too)."""
    from library.families.qwen_image.loading import write_qwen_image_preset

    paths = write_qwen_image_preset("tiny:qwen_image", str(tmp_path_factory.mktemp("qwen-gguf")), True)
    sd = load_file(paths["dit"])
    for qtype in ("Q8_0", "Q4_0"):
        paths[qtype] = paths["dit"][:-len(".safetensors")] + f"-{qtype}.gguf"
        # 32 2-D weights quantized; 1-D tensors and img_in / txt_in (city96's convert.py) F32
        assert Counter(write_gguf(paths[qtype], sd, qtype, "qwen_image").values()) == {qtype: 32, "F32": 45}
    paths["Q8_0-all"] = paths["dit"][:-len(".safetensors")] + "-Q8_0-all.gguf"
    assert Counter(write_gguf(paths["Q8_0-all"], sd, "Q8_0", "qwen_image", full_precision=()).values()) == {
        "Q8_0": 34, "F32": 43}
    return paths


def _qwen_run(model, images=1):
    """The DiT's output on fixed inputs: `images` 4x4-patch images (the target, then the edit models' controls)."""
    g = torch.Generator().manual_seed(0)
    kw = dict(hidden_states=torch.randn(1, 16 * images, 64, generator=g),
              encoder_hidden_states=torch.randn(1, 7, 32, generator=g),
              encoder_hidden_states_mask=torch.ones(1, 7, dtype=torch.bool), timestep=torch.tensor([0.6]),
              img_shapes=[[(1, 4, 4)] * images], return_dict=False)
    with torch.no_grad():
        return model(**kw)[0]


# ‖GGUF − fp32‖ / ‖fp32‖ of tiny:qwen_image's DiT output, measured: Q8_0 3.7e-3, Q4_0 6.3e-2, Q8_0 with img_in /
# txt_in quantized too 5.1e-3. That the gap is only the quantization is checked exactly below.
QWEN_TOLERANCE = {"Q8_0": 0.01, "Q4_0": 0.15, "Q8_0-all": 0.012}


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q8_0-all"])
def test_qwen_image_gguf_loads_quantized_and_computes_close(qwen_ggufs, kind):
    """The .gguf is a single DiT file (by name and by magic), its config is read from the logical shapes (with
    img_in / txt_in quantized, their byte shapes would give 68 inputs and a 34-wide text input), and every Linear
    whose weight is quantized in the file is a GgufLinear."""
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    from library.families.qwen_image.configs import transformer_config as qwen_config
    from library.families.qwen_image.configs import PRESETS as QWEN_PRESETS
    from library.families.qwen_image.loading import block_count, load_dit_file, source_kind

    path = qwen_ggufs[kind]
    assert source_kind(path) == "single_file" and block_count(path) == 2
    ref = load_dit_file(qwen_ggufs["dit"], torch.float32)
    model = load_dit_file(path, torch.float32)
    expected = {k: v for k, v in qwen_config(QWEN_PRESETS["tiny:qwen_image"]).items()}
    assert {k: model.config[k] for k in expected} == {k: ref.config[k] for k in expected}
    layers = [m for m in model.modules() if type(m).__name__ == "GgufLinear"]
    assert len(layers) == (34 if kind == "Q8_0-all" else 32) and quantized_layers([model]) == len(layers)
    assert {k for k, _ in model.named_parameters()} == {k for k, _ in ref.named_parameters()}
    a, b = _qwen_run(ref), _qwen_run(model)
    rel = ((a - b).norm() / a.norm()).item()
    print(f"Qwen-Image {kind}: relative output error {rel:.3g}")
    assert rel <= QWEN_TOLERANCE[kind]
    state = {k: (dequantize_gguf_tensor(v).float() if is_quantized(v) else v) for k, v in model.state_dict().items()}
    ref.load_state_dict(state)
    assert torch.equal(_qwen_run(ref), b)  # the same ops on the same values


def test_qwen_image_refuses_another_architecture(ggufs, qwen_ggufs, tmp_path):
    """A FLUX.1 GGUF given to Qwen-Image, and a Qwen-Image GGUF given to FLUX.1, are named in one line."""
    from library.families.flux.loading import load_bfl_transformer
    from library.families.qwen_image.loading import load_dit_file

    with pytest.raises(ModelLoadError) as e:
        load_dit_file(ggufs["Q8_0"], torch.float32)
    assert str(e.value) == (f"--pretrained_model_name_or_path {ggufs['Q8_0']}: a GGUF file of architecture 'flux'; "
                            "expected a Qwen-Image DiT (transformer_blocks.*.img_mod keys) "
                            "(general.architecture 'qwen_image')")
    with pytest.raises(ModelLoadError, match=r"^[^\n]*a GGUF file of architecture 'qwen_image'; expected [^\n]*$"):
        load_bfl_transformer(qwen_ggufs["Q8_0"], torch.float32)


def test_qwen_image_edit_2511_gguf_through_the_family(tmp_path):
    """Qwen-Image-Edit's DiT is the same architecture: tiny:qwen_image_edit's DiT as a Q8_0 .gguf with ComfyUI's
    empty __index_timestep_zero__ marker (Edit-2511 files) loads through the family with --model_version edit-2511
    (zero_cond_t set, as on the .safetensors DiT) and computes close to it on a target and a control image; another
    --model_version is refused in one line, as musubi-tuner does."""
    from library.families.qwen_image.loading import write_qwen_image_preset
    from library.families.qwen_image.options import QwenImageOptions

    files = write_qwen_image_preset("tiny:qwen_image_edit", str(tmp_path / "edit"), True)
    gguf_path = str(tmp_path / "edit" / "qwen-image-edit-2511-Q8_0.gguf")
    sd = {**load_file(files["dit"]), "__index_timestep_zero__": torch.empty(0)}
    assert Counter(write_gguf(gguf_path, sd, "Q8_0", "qwen_image").values()) == {"Q8_0": 32, "F32": 46}
    family = get_family("qwen_image")

    def load(path, version="edit-2511"):
        options = QwenImageOptions(model_version=version, text_encoder=files["text_encoder"])
        return family.load(LoadOptions(path, vae=files["vae"], family_options=options))

    with pytest.raises(ModelLoadError) as e:
        load(gguf_path, "edit-2509")
    assert str(e.value) == (f"--model_version edit-2509: {gguf_path} is a Qwen-Image-Edit-2511 DiT (it holds "
                            "ComfyUI's __index_timestep_zero__ marker); give --model_version edit-2511")

    ref, c = load(files["dit"]), load(gguf_path)
    assert c.denoiser.config.zero_cond_t and c.denoiser.transformer_blocks[1].zero_cond_t
    assert quantized_layers([c.denoiser]) == 32 and c.text_encoders[0].visual is not None
    a, b = _qwen_run(ref.denoiser, images=2), _qwen_run(c.denoiser, images=2)
    rel = ((a - b).norm() / a.norm()).item()
    print(f"Qwen-Image-Edit-2511 Q8_0: relative output error {rel:.3g}")
    assert rel <= QWEN_TOLERANCE["Q8_0"]


def test_qwen_image_full_fine_tune_refuses_a_gguf_base(qwen_ggufs):
    path = qwen_ggufs["Q8_0"]
    with pytest.raises(ConfigError) as e:
        memory_options_from_args({"pretrained_model_name_or_path": path}, get_family("qwen_image"), True)
    assert str(e.value) == (f"--pretrained_model_name_or_path {path}: a GGUF file holds quantized weights, which a "
                            "full fine-tune cannot train; use a LoRA script (*_train_network.py) or the .safetensors "
                            "model")


def _qwen_train(tmp_path, qwen_ggufs, name, model, extra=(), steps=3):
    data = make_dataset(str(tmp_path / "data"), n=2)
    trainer = make_trainer(base_args(data, str(tmp_path / name), model, steps=steps, extra=[
        "--network_module", "networks.lora_qwen_image", "--cache_text_encoder_outputs", "--cache_latents",
        "--network_train_unet_only", "--gradient_checkpointing", "--text_encoder", qwen_ggufs["text_encoder"],
        "--vae", qwen_ggufs["vae"], *extra]), "qwen_image")
    return load_file(trainer.run()), trainer


def test_qwen_image_lora_on_a_gguf_base(qwen_ggufs, tmp_path):
    """qwen_image_train_network.py from the Q8_0 .gguf (gradient checkpointing, a sample during training) against
    the .safetensors DiT (same seed) and against the .safetensors DiT with another --seed (the scale of a real
    difference): the same keys and dtypes, finite, and the GGUF LoRA far closer to the full-precision one than
    another seed is."""
    def train(name, model, extra=()):
        return _qwen_train(tmp_path, qwen_ggufs, name, model, extra)

    full, _ = train("full", qwen_ggufs["dit"])
    other, _ = train("seed", qwen_ggufs["dit"], ["--seed", "7"])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("sks toy --w 32 --h 32 --s 2 --d 1\n")
    lora, trainer = train("gguf", qwen_ggufs["Q8_0"], ["--sample_prompts", str(prompts), "--sample_every_n_steps", "3"])
    assert quantized_layers([trainer.components.denoiser]) == 32
    samples = [f for f in os.listdir(tmp_path / "gguf" / "sample") if f.startswith("lora_000003_00_")]
    assert len(samples) == 1, samples  # the sample at step 3 ran through the GGUF layers
    assert lora.keys() == full.keys() and len(lora) == 24 * 3
    assert all(lora[k].dtype == full[k].dtype for k in lora)
    assert all(torch.isfinite(v).all() for v in lora.values())
    rel, scale = _relative_difference(lora, full), _relative_difference(other, full)
    print(f"Qwen-Image Q8_0: relative ΔW difference {rel:.3g}; another seed in full precision {scale:.3g}")
    assert rel <= QWEN_LORA_TOLERANCE and scale >= 10 * QWEN_LORA_TOLERANCE


# relative ΔW difference after 3 steps, measured: Q8_0 vs the fp32 .safetensors DiT 0.047; another --seed in
# full precision 1.38
QWEN_LORA_TOLERANCE = 0.1

