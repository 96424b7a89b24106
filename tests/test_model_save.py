"""ModelFamily.save_model: every format of every family round-trips through diffusers' own loaders and the
family's loader with every tensor as saved (exact, or exact after the requested cast); mem_eff writes the same
tensors; golden key counts per format; names from model_save_path; the live model is never changed
(the session's shared-model check after this module)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from library.core.errors import UserError
from library.families import get_family
from library.families.base import SAVE_FORMATS, LoadOptions, model_save_path
from library.families.flux.options import FluxOptions

CASES = {"sd1": ("sd", "tiny_sd1"), "sd2v": ("sd", "tiny_sd2v"), "sdxl": ("sdxl", "tiny_sdxl"),
         "flux": ("flux", "tiny_flux")}
# (family case, format): keys in the single file, or in all weight files of the folder.
GOLDEN_KEYS = {
    # SD 1.x: UNet 686 + VAE 248 + CLIP-L 196 keys in both layouts (as real SD 1.5 files, less position_ids).
    ("sd1", "safetensors"): 1130, ("sd1", "ckpt"): 1130, ("sd1", "diffusers"): 1130, ("sd1", "diffusers_safetensors"): 1130,
    # SD 2.x: OpenCLIP fuses q/k/v (3 tensors -> 1 per layer) and adds the 24th layer, text_projection, logit_scale.
    ("sd2v", "safetensors"): 1228, ("sd2v", "ckpt"): 1228, ("sd2v", "diffusers"): 1306,
    ("sd2v", "diffusers_safetensors"): 1306,
    ("sdxl", "safetensors"): 2514, ("sdxl", "ckpt"): 2514, ("sdxl", "diffusers"): 2641,
    ("sdxl", "diffusers_safetensors"): 2641,
    # FLUX.1: the BFL file holds the transformer alone (fused qkv / linear1); the folder every part.
    ("flux", "safetensors"): 92, ("flux", "diffusers"): 781, ("flux", "diffusers_safetensors"): 781,
}
FOLDER_PARTS = {"sd": ("unet", "vae", "text_encoder"), "sdxl": ("unet", "vae", "text_encoder", "text_encoder_2"),
                "flux": ("transformer", "vae", "text_encoder", "text_encoder_2")}
PIPELINES = {"sd": "StableDiffusionPipeline", "sdxl": "StableDiffusionXLPipeline", "flux": "FluxPipeline"}


def _components(request, case):
    return request.getfixturevalue(CASES[case][1])


def _modules(components) -> dict[str, torch.nn.Module]:
    return {"denoiser": components.denoiser, "vae": components.vae,
            **{f"text_encoder_{i}": te for i, te in enumerate(components.text_encoders)}}


def _assert_same(got: torch.nn.Module, saved: torch.nn.Module, dtype=None, what=""):
    a, b = got.state_dict(), saved.state_dict()
    assert a.keys() == b.keys(), what
    for k, v in b.items():
        want = v.to(dtype) if dtype is not None and v.is_floating_point() else v
        assert torch.equal(a[k].to(want.dtype), want), f"{what}: {k}"


def _weight_files(root: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith((".safetensors", ".bin")))


def _read(path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        return load_file(path)
    data = torch.load(path, map_location="cpu", weights_only=True)
    return data.get("state_dict", data)


def _key_count(path: str) -> int:
    return sum(len(_read(f)) for f in (_weight_files(path) if os.path.isdir(path) else [path]))


def _formats(case):
    return [f for f in SAVE_FORMATS if not (case == "flux" and f == "ckpt")]


ALL = [(case, fmt) for case in CASES for fmt in _formats(case)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{(case, fmt, dtype name): path} written once per module by the first test that asks."""
    return {"root": str(tmp_path_factory.mktemp("model-save"))}


def _save(request, saved, case, fmt, dtype=None, mem_eff=False, metadata=None):
    key = (case, fmt, str(dtype), mem_eff, bool(metadata))
    if key not in saved:
        family, _ = CASES[case]
        stem = f"{case}-{fmt}-{str(dtype).split('.')[-1]}{'-memeff' if mem_eff else ''}{'-meta' if metadata else ''}"
        path = model_save_path(saved["root"], stem, fmt)
        written = get_family(family).save_model(_components(request, case), path, fmt, dtype, metadata, mem_eff)
        assert written == path
        saved[key] = path
    return saved[key]


def _own_load(case, path, flux_files):
    family, _ = CASES[case]
    options = None
    if family == "flux" and os.path.isfile(path):
        options = FluxOptions(clip_l=flux_files["clip_l"], t5xxl=flux_files["t5xxl"], ae=flux_files["ae"])
    return get_family(family).load(LoadOptions(path, v_parameterization=case == "sd2v", family_options=options))


@pytest.mark.parametrize("case,fmt", ALL)
@pytest.mark.parametrize("dtype", [None, torch.float16])
def test_round_trip_through_the_family_loader(request, saved, case, fmt, dtype, tiny_flux_files):
    components = _components(request, case)
    path = _save(request, saved, case, fmt, dtype)
    back = _own_load(case, path, tiny_flux_files)
    modules = _modules(components)
    if case == "flux" and fmt == "safetensors":  # the BFL file holds the transformer alone
        modules = {"denoiser": modules["denoiser"]}
    loaded = _modules(back)
    for name, module in modules.items():
        _assert_same(loaded[name], module, dtype, f"{case} {fmt} {name}")
    assert back.v_parameterization == components.v_parameterization and back.v2 == components.v2


def _diffusers_single_file(case, path, reference_folder):
    import diffusers

    if case == "flux":
        transformer = diffusers.FluxTransformer2DModel.from_single_file(path, config=reference_folder,
                                                                         subfolder="transformer", local_files_only=True)
        return {"denoiser": transformer}
    pipe = getattr(diffusers, PIPELINES[CASES[case][0]]).from_single_file(path, config=reference_folder,
                                                                         local_files_only=True)
    return {"denoiser": pipe.unet, "vae": pipe.vae, "text_encoder_0": pipe.text_encoder,
            **({"text_encoder_1": pipe.text_encoder_2} if case == "sdxl" else {})}


def _diffusers_folder(case, path):
    import diffusers

    pipe = getattr(diffusers, PIPELINES[CASES[case][0]]).from_pretrained(path, local_files_only=True)
    out = {"denoiser": pipe.transformer if case == "flux" else pipe.unet, "vae": pipe.vae,
           "text_encoder_0": pipe.text_encoder}
    if getattr(pipe, "text_encoder_2", None) is not None:
        out["text_encoder_1"] = pipe.text_encoder_2
    if case == "sd2v":
        assert pipe.scheduler.config.prediction_type == "v_prediction"
    return out


@pytest.mark.parametrize("case,fmt", ALL)
def test_round_trip_through_diffusers(request, saved, case, fmt):
    """from_single_file (configured from a diffusers folder of the same preset) and from_pretrained."""
    if case == "flux" and fmt == "safetensors":
        pytest.skip("diffusers' Flux single-file converter hard-codes FLUX.1's inner_dim 3072 and mlp_ratio 4 "
                    "(convert_flux_transformer_checkpoint_to_diffusers), so it cannot read the tiny model")
    components = _components(request, case)
    path = _save(request, saved, case, fmt, torch.bfloat16)
    if fmt in ("diffusers", "diffusers_safetensors"):
        loaded = _diffusers_folder(case, path)
    else:
        loaded = _diffusers_single_file(case, path, _save(request, saved, case, "diffusers_safetensors"))
    modules = _modules(components)
    assert set(loaded) == (set(modules) if case != "flux" or fmt != "safetensors" else {"denoiser"})
    for name, module in loaded.items():
        _assert_same(module, modules[name], torch.bfloat16, f"{case} {fmt} {name}")


@pytest.mark.parametrize("case,fmt", ALL)
def test_golden_key_counts_and_file_names(request, saved, case, fmt):
    path = _save(request, saved, case, fmt)
    assert _key_count(path) == GOLDEN_KEYS[(case, fmt)]
    names = {os.path.relpath(f, path) for f in _weight_files(path)} if os.path.isdir(path) else {os.path.basename(path)}
    family = CASES[case][0]
    if fmt == "diffusers":
        assert all(n.endswith(".bin") for n in names) and len(names) == len(FOLDER_PARTS[family]), names
    elif fmt == "diffusers_safetensors":
        assert all(n.endswith(".safetensors") for n in names) and len(names) == len(FOLDER_PARTS[family])
        assert {os.path.dirname(n) for n in names} == set(FOLDER_PARTS[family])
    else:
        assert names == {f"{os.path.basename(path)}"} and path.endswith(f".{fmt}")
    # atomic writes leave nothing beside the result
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.startswith(".")]


def test_single_file_layouts(request, saved):
    """The key prefixes ComfyUI, A1111 / Forge and sd-scripts look for."""
    layouts = {"model.diffusion_model.", "first_stage_model.", "cond_stage_model.transformer.", "cond_stage_model.model."}

    def prefixes(case):
        return {next(p for p in layouts if k.startswith(p)) for k in _read(_save(request, saved, case, "safetensors"))}

    assert prefixes("sd1") == {"model.diffusion_model.", "first_stage_model.", "cond_stage_model.transformer."}
    assert prefixes("sd2v") == {"model.diffusion_model.", "first_stage_model.", "cond_stage_model.model."}
    sdxl = _read(_save(request, saved, "sdxl", "safetensors"))
    assert {k.split(".")[0] for k in sdxl} == {"model", "first_stage_model", "conditioner"}
    assert any(k.startswith("conditioner.embedders.0.transformer.") for k in sdxl)
    assert any(k.startswith("conditioner.embedders.1.model.") for k in sdxl)
    flux = _read(_save(request, saved, "flux", "safetensors"))
    assert "double_blocks.0.img_attn.qkv.weight" in flux and not any(k.startswith("model.") for k in flux)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_mem_eff_writes_the_same_tensors(request, saved, case, dtype):
    for fmt in ("safetensors", "diffusers_safetensors"):
        plain = _save(request, saved, case, fmt, dtype, metadata={"modelspec.title": "x"})
        lean = _save(request, saved, case, fmt, dtype, mem_eff=True, metadata={"modelspec.title": "x"})
        plain_files, lean_files = _weight_files(plain) or [plain], _weight_files(lean) or [lean]
        assert [os.path.relpath(f, plain) for f in plain_files] == [os.path.relpath(f, lean) for f in lean_files]
        for a_path, b_path in zip(plain_files, lean_files):
            a, b = load_file(a_path), load_file(b_path)
            assert a.keys() == b.keys()
            for k in a:
                assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
                if dtype is not None and a[k].is_floating_point():
                    assert a[k].dtype == dtype
            with safe_open(a_path, "pt") as fa, safe_open(b_path, "pt") as fb:
                assert fa.metadata() == fb.metadata()


def test_metadata_and_ckpt_counters(request, tmp_path, tiny_sd1):
    family = get_family("sd")
    meta = {"modelspec.architecture": "stable-diffusion-v1", "modelspec.title": "t"}
    st = family.save_model(tiny_sd1, str(tmp_path / "m.safetensors"), "safetensors", metadata=meta, epoch=3)
    with safe_open(st, "pt") as f:
        assert f.metadata() == meta
    ckpt = family.save_model(tiny_sd1, str(tmp_path / "m.ckpt"), "ckpt", None, meta, epoch=3, global_step=120)
    data = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert (data["epoch"], data["global_step"]) == (3, 120) and set(data) == {"state_dict", "epoch", "global_step"}
    plain = torch.load(family.save_model(tiny_sd1, str(tmp_path / "n.ckpt"), "ckpt"), weights_only=True)
    assert (plain["epoch"], plain["global_step"]) == (0, 0)


def test_model_save_path_and_refusals(tmp_path, tiny_flux):
    assert model_save_path("out", "last", "safetensors") == os.path.join("out", "last.safetensors")
    assert model_save_path("out", "e-000001", "ckpt") == os.path.join("out", "e-000001.ckpt")
    assert model_save_path("out", "last", "diffusers") == os.path.join("out", "last")
    assert model_save_path("out", "last", "diffusers_safetensors") == os.path.join("out", "last")
    with pytest.raises(UserError, match="--save_model_as takes ckpt, safetensors, diffusers, diffusers_safetensors"):
        model_save_path("out", "last", "pt")
    with pytest.raises(UserError, match=r"cannot save a flux model as ckpt"):
        get_family("flux").save_model(tiny_flux, str(tmp_path / "f.ckpt"), "ckpt")
    assert not os.listdir(tmp_path)


def test_replacing_an_existing_folder_is_atomic(tmp_path, tiny_sd1):
    family = get_family("sd")
    path = str(tmp_path / "last")
    old = os.umask(0o027)
    try:
        family.save_model(tiny_sd1, path, "diffusers_safetensors")
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o750  # the folder follows the umask (mkdtemp alone gives 0700)
    family.save_model(tiny_sd1, path, "diffusers_safetensors", torch.float16)
    assert os.listdir(tmp_path) == ["last"]
    assert load_file(os.path.join(path, "unet", "diffusion_pytorch_model.safetensors"))["conv_in.weight"].dtype \
        == torch.float16


# --- --from_scratch -------------------------------------------------------------------------------------------

def _scratch_sources(request, case):
    """(path, family options) of a file or folder of the preset: single files for SD / FLUX.1, a folder for SDXL."""
    if case == "sd1":
        return request.getfixturevalue("tiny_sd1_file"), None
    if case == "sdxl":
        return request.getfixturevalue("tiny_sdxl_folder"), None
    files = request.getfixturevalue("tiny_flux_files")
    return files["transformer"], FluxOptions(clip_l=files["clip_l"], t5xxl=files["t5xxl"], ae=files["ae"])


@pytest.mark.parametrize("case", ["sd1", "sdxl", "flux"])
def test_from_scratch_draws_the_denoiser_from_the_seed(request, case):
    family = get_family(CASES[case][0])
    path, options = _scratch_sources(request, case)
    loaded = family.load(LoadOptions(path, family_options=options))
    rng = torch.get_rng_state()
    first = family.load(LoadOptions(path, family_options=options, from_scratch=True, init_seed=7))
    again = family.load(LoadOptions(path, family_options=options, from_scratch=True, init_seed=7))
    other = family.load(LoadOptions(path, family_options=options, from_scratch=True, init_seed=8))
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's RNG is left as it was
    _assert_same(again.denoiser, first.denoiser, what="same seed")
    def config(model):
        return {k: v for k, v in model.config.items() if not k.startswith("_")}  # not _name_or_path

    assert type(first.denoiser) is type(loaded.denoiser) and config(first.denoiser) == config(loaded.denoiser)
    for name, tensor in first.denoiser.state_dict().items():
        if tensor.numel() > 16 and tensor.std() > 0:  # weights drawn at random (not the constant norms / biases)
            assert not torch.equal(tensor, loaded.denoiser.state_dict()[name]), name
            assert not torch.equal(tensor, other.denoiser.state_dict()[name]), name
    assert not first.denoiser.training
    for name in ("vae", "text_encoder_0", "text_encoder_1"):
        if name in _modules(loaded):
            _assert_same(_modules(first)[name], _modules(loaded)[name], what=name)


def test_from_scratch_flag_and_seed(tmp_path):
    from library.cli.entry import build_parser, settings_from_args

    family = get_family("sd")
    base = ["--pretrained_model_name_or_path", "tiny:sd1", "--output_dir", str(tmp_path),
            "--train_data_dir", str(tmp_path)]
    model = settings_from_args(build_parser("", family).parse_args(base + ["--from_scratch", "--seed", "5"]), family).model
    assert (model.from_scratch, model.init_seed) == (True, 5)
    drawn = settings_from_args(build_parser("", family).parse_args(base + ["--from_scratch"]), family)
    assert drawn.model.init_seed == drawn.training.seed
    assert not settings_from_args(build_parser("", family).parse_args(base), family).model.from_scratch


def test_from_scratch_reads_no_denoiser_weights_from_a_folder(tmp_path, tiny_sd1, tiny_sd1_file):
    """A diffusers folder's UNet is built from its config.json (its weight file may be absent) and equals the
    UNet drawn with the same seed from the single file of the same model."""
    family = get_family("sd")
    folder = family.save_model(tiny_sd1, str(tmp_path / "sd1"), "diffusers_safetensors")
    os.remove(os.path.join(folder, "unet", "diffusion_pytorch_model.safetensors"))
    from_folder = family.load(LoadOptions(folder, from_scratch=True, init_seed=7))
    from_file = family.load(LoadOptions(tiny_sd1_file, from_scratch=True, init_seed=7))
    _assert_same(from_folder.denoiser, from_file.denoiser, what="folder vs file")
    _assert_same(from_folder.text_encoders[0], tiny_sd1.text_encoders[0], what="text encoder")
