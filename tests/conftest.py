"""Test-wide settings (offline, one intra-op thread) and the tiny models every test file shares.

Multi-threaded CPU kernels (attention, convolution backward) may sum in a different order
from run to run, which changes the last bits of a result; with one thread every run is
bitwise repeatable, which the resume tests rely on. Tiny models lose nothing by it.

The tiny models of the real architectures and their on-disk layouts are built once per test session
and kept in the session-scoped `tiny_store`:

* `tiny_sd1`, `tiny_sd2`, `tiny_sd2v`, `tiny_sdxl`, `tiny_flux`: the `Components` that
  `get_family(...).load(LoadOptions("tiny:..."))` returns, built by the first test that asks. Shared: a
  test may run them, and hook a network in if it restores it, but must not change them.
* `tiny_sd1_modules`, `tiny_sd2_modules`, `tiny_sdxl_modules`, `tiny_flux_modules`: the same shared models
  as the dict the preset builders return (`build_sd_modules`, `build_sdxl_modules`, `build_flux_modules`).
* `tiny_sd1_copy`, `tiny_sdxl_copy`, `tiny_flux_copy`: a private deep copy for a test that changes the
  model (merges a LoRA into it, leaves a network hooked in, changes a weight, ...).
* `tiny_sd1_file` (LDM single file), `tiny_sdxl_file` (SGM single file), `tiny_sdxl_folder` (diffusers),
  `tiny_flux_files` (BFL transformer + clip_l / t5xxl / ae), `tiny_flux_folder` (diffusers): session-scoped,
  written once into the session's temporary folder; read-only for the tests.

After each test module, the shared models it used and every shared file are compared with the state they
were built in (weights by CRC-32, dtypes, requires_grad, train/eval, no forward left patched by a network;
file sizes and times), so a test that changes one fails there instead of silently changing what later tests see.
"""

from __future__ import annotations

import copy
import gc
import os
import re
import shutil
import tempfile
import zlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("LORA_TOOLKIT_CACHE_DIR", tempfile.mkdtemp(prefix="lora-toolkit-test-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def _freeze_long_lived() -> None:
    """Collect, then move every object alive now to the garbage collector's permanent generation.

    The objects of torch / diffusers / transformers and of the shared tiny models (some 400 000) live
    for the whole session; every full collection would walk them again (about 0.25 s each, dozens of
    times a run, and at each gc.collect() of the sampling hook). Frozen, they are skipped. Reference
    counting still frees everything as before; only cycles among frozen objects are never collected.
    """
    gc.collect()
    gc.freeze()


def pytest_collection_finish(session):
    _freeze_long_lived()  # the test modules and everything they import


# Modules whose tests launch several training processes at once (torchrun / accelerate with 2 processes, the web
# UI's runs). Under pytest-xdist (scripts/test.sh runs 2 workers, --dist loadgroup) they share one group, so one
# worker runs them one after another while the other worker runs the in-process tests: never two 2-process
# launches on 2 cores at the same time.
MULTIPROCESS_MODULES = frozenset({"test_distributed", "test_fsdp", "test_deepspeed", "test_webui_browser",
                                  "test_stop_signals"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in MULTIPROCESS_MODULES:
            item.add_marker(pytest.mark.xdist_group("multiprocess"))


# --- checks that shared things stay as built -----------------------------------------------------------------

def _fingerprint(t: torch.Tensor) -> tuple:
    """dtype, shape and a CRC-32 of the bytes: as fast as comparing with a clone, without keeping one."""
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return str(t.dtype), tuple(t.shape), t.device.type, zlib.crc32(data)


def _module_state(module: torch.nn.Module) -> dict:
    return {
        "tensors": {k: _fingerprint(v) for k, v in module.state_dict().items()},
        "requires_grad": [(n, p.requires_grad) for n, p in module.named_parameters()],
        "training": [(n, m.training) for n, m in module.named_modules()],
        # Submodules with an instance `forward`: a LoRA / LyCORIS module left hooked in. (Forward hooks are not
        # counted: transformers installs its output-capturing hooks on the first output_hidden_states=True call.)
        "patched": [n or "<root>" for n, m in module.named_modules() if "forward" in m.__dict__],
    }


class _SharedModel:
    """A session model and a snapshot of it, to tell whether a test changed it."""

    def __init__(self, name: str, components):
        self.name = name
        self.components = components
        self.snapshot()

    def _modules(self) -> dict[str, torch.nn.Module]:
        c = self.components
        return {"denoiser": c.denoiser, "vae": c.vae, **{f"text_encoders[{i}]": m for i, m in enumerate(c.text_encoders)}}

    def _fields(self) -> tuple:
        c = self.components
        return ([id(m) for m in self._modules().values()], [id(t) for t in c.tokenizers], [len(t) for t in c.tokenizers],
                c.v_parameterization, c.v2, c.model_path, c.vae_path, repr(c.options))

    def snapshot(self) -> None:
        self.fields = self._fields()
        self.states = {name: _module_state(m) for name, m in self._modules().items()}

    def changes(self) -> list[str]:
        found = []
        if self._fields() != self.fields:
            found.append(f"{self.name}: a part, tokenizer, flag or the options were replaced")
            return found
        for name, module in self._modules().items():
            before, now = self.states[name], _module_state(module)
            where = f"{self.name} {name}"
            if before["tensors"].keys() != now["tensors"].keys():
                found.append(f"{where}: state dict keys changed")
            else:
                changed = [k for k, v in now["tensors"].items() if v != before["tensors"][k]]
                if changed:
                    found.append(f"{where}: {len(changed)} tensors changed (e.g. {changed[0]})")
            if now["requires_grad"] != before["requires_grad"]:
                found.append(f"{where}: requires_grad changed")
            if now["training"] != before["training"]:
                found.append(f"{where}: train/eval mode changed")
            patched = [n for n in now["patched"] if n not in before["patched"]]
            if patched:
                found.append(f"{where}: forward patched at {patched[0]} (a network was not restored)")
        return found


class _SharedFiles:
    """Files written once per session and a listing (sizes, modification times) to tell whether a test changed them."""

    def __init__(self, name: str, root: str):
        self.name = name
        self.root = root
        self.snapshot()

    def _listing(self) -> dict[str, tuple[int, int]]:
        if os.path.isfile(self.root):
            paths = [self.root]
        else:
            paths = [os.path.join(d, f) for d, _, files in os.walk(self.root) for f in files]
        return {p: (os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths}

    def snapshot(self) -> None:
        self.listing = self._listing()

    def changes(self) -> list[str]:
        return [f"{self.name}: files under {self.root} were added, removed or rewritten"] \
            if self._listing() != self.listing else []


class _SessionStore:
    """The session's shared tiny models (each built by the first test that asks for it) and files on disk."""

    def __init__(self):
        self.models: dict[str, _SharedModel] = {}
        self.files: dict[str, _SharedFiles] = {}
        self.used: set[str] = set()  # the models the current test module used

    @staticmethod
    def is_tiny_preset(preset: str) -> bool:
        """Whether a registered family lists `preset` among its tiny presets (the store can build it)."""
        from library.families import registered_families

        return any(preset in f.tiny_presets for f in registered_families())

    def model(self, preset: str, share: bool = True):
        """The shared Components of `preset`; share=False: only to copy it (not checked for changes then)."""
        if preset not in self.models:
            from library.families import registered_families
            from library.families.base import LoadOptions

            # The family whose facts list the preset among its tiny presets.
            (family,) = [f for f in registered_families() if preset in f.tiny_presets]
            self.models[preset] = _SharedModel(preset, family.load(LoadOptions(preset)))
            _freeze_long_lived()
        if share:
            self.used.add(preset)
        return self.models[preset].components

    def written(self, name: str, tmp_path_factory, write) -> str:
        """`write(folder)` once into a new session folder; returns what it returned (the path written)."""
        if name not in self.files:
            folder = str(tmp_path_factory.mktemp(re.sub(r"[^A-Za-z0-9]+", "-", name)))
            self.files[name] = _SharedFiles(name, write(folder))
        return self.files[name].root

    def changes(self) -> list[str]:
        """What changed since the last check, in the models used since then and in every shared file."""
        checked = [self.models[p] for p in self.used] + list(self.files.values())
        self.used.clear()
        problems = [p for shared in checked for p in shared.changes()]
        if problems:  # reported once, not again after every later module
            for shared in checked:
                shared.snapshot()
        return problems


@pytest.fixture(scope="session")
def tiny_store():
    """The session's store of shared tiny models and files; tests use the tiny_* fixtures below."""
    return _SessionStore()


@pytest.fixture(scope="module", autouse=True)
def _shared_models_stay_unchanged(request, tiny_store):
    """After each test module: the shared tiny models it used, and the shared files, are as they were built."""
    yield
    problems = tiny_store.changes()
    if problems:
        pytest.fail(f"{request.module.__name__} changed what the test session shares: " + "; ".join(problems)
                    + ". Give the test that changes it its own copy (tiny_*_copy) or its own files.")


# --- the shared tiny models ------------------------------------------------------------------------------------

@pytest.fixture
def tiny_sd1(tiny_store):
    """tiny:sd1 as `get_family("sd").load(LoadOptions("tiny:sd1"))` returns it, built once per session
    (shared: do not change it)."""
    return tiny_store.model("tiny:sd1")


@pytest.fixture
def tiny_sd2(tiny_store):
    """tiny:sd2 as `get_family("sd").load` returns it, built once per session (shared: do not change it)."""
    return tiny_store.model("tiny:sd2")


@pytest.fixture
def tiny_sd2v(tiny_store):
    """tiny:sd2-v (v-prediction) as `get_family("sd").load` returns it, built once per session (shared)."""
    return tiny_store.model("tiny:sd2-v")


@pytest.fixture
def tiny_sdxl(tiny_store):
    """tiny:sdxl as `get_family("sdxl").load` returns it, built once per session (shared: do not change it)."""
    return tiny_store.model("tiny:sdxl")


@pytest.fixture
def tiny_flux(tiny_store):
    """tiny:flux as `get_family("flux").load` returns it (default FluxOptions), built once per session (shared)."""
    return tiny_store.model("tiny:flux")


@pytest.fixture
def tiny_sd3(tiny_store):
    """tiny:sd3 as `get_family("sd3").load` returns it (default SD3Options), built once per session (shared)."""
    return tiny_store.model("tiny:sd3")


@pytest.fixture
def tiny_sd3_copy(tiny_store):
    """A private copy of tiny:sd3 (of the shared one: no build) for a test that changes the model."""
    return copy.deepcopy(tiny_store.model("tiny:sd3", share=False))


def _sd_modules(c) -> dict:
    return {"unet": c.denoiser, "vae": c.vae, "text_encoder": c.text_encoders[0], "tokenizer": c.tokenizers[0]}


@pytest.fixture
def tiny_sd1_modules(tiny_sd1):
    """The shared tiny:sd1 as `build_sd_modules("tiny:sd1")` returns it: {"unet", "vae", "text_encoder", "tokenizer"}."""
    return _sd_modules(tiny_sd1)


@pytest.fixture
def tiny_sd2_modules(tiny_sd2):
    """The shared tiny:sd2 as `build_sd_modules("tiny:sd2")` returns it."""
    return _sd_modules(tiny_sd2)


@pytest.fixture
def tiny_sdxl_modules(tiny_sdxl):
    """The shared tiny:sdxl as `build_sdxl_modules("tiny:sdxl")` returns it."""
    c = tiny_sdxl
    return {"unet": c.denoiser, "vae": c.vae, "text_encoder": c.text_encoders[0], "text_encoder_2": c.text_encoders[1],
            "tokenizer": c.tokenizers[0], "tokenizer_2": c.tokenizers[1]}


@pytest.fixture
def tiny_flux_modules(tiny_flux):
    """The shared tiny:flux as `build_flux_modules("tiny:flux")` returns it."""
    c = tiny_flux
    return {"transformer": c.denoiser, "vae": c.vae, "text_encoder": c.text_encoders[0],
            "text_encoder_2": c.text_encoders[1], "tokenizer": c.tokenizers[0], "tokenizer_2": c.tokenizers[1]}


@pytest.fixture
def tiny_sd1_copy(tiny_store):
    """A private copy of tiny:sd1 (of the shared one: no build) for a test that changes the model."""
    return copy.deepcopy(tiny_store.model("tiny:sd1", share=False))


@pytest.fixture
def tiny_sdxl_copy(tiny_store):
    """A private copy of tiny:sdxl (of the shared one: no build) for a test that changes the model."""
    return copy.deepcopy(tiny_store.model("tiny:sdxl", share=False))


@pytest.fixture
def tiny_flux_copy(tiny_store):
    """A private copy of tiny:flux (of the shared one: no build) for a test that changes the model."""
    return copy.deepcopy(tiny_store.model("tiny:flux", share=False))


# --- the tiny models on disk, written once ----------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_sd1_file(tiny_store, tmp_path_factory) -> str:
    """tiny:sd1 as one LDM-layout .safetensors file (library.families.sd.saving.write_preset)."""
    def write(root):
        from library.families.sd.saving import write_preset

        path = os.path.join(root, "tiny-sd1.safetensors")
        write_preset("tiny:sd1", path, single_file=True)
        return path

    return tiny_store.written("tiny:sd1 file", tmp_path_factory, write)


@pytest.fixture(scope="session")
def tiny_sdxl_file(tiny_store, tmp_path_factory) -> str:
    """tiny:sdxl as one SGM-layout .safetensors file (library.families.sdxl.saving.write_sdxl_preset)."""
    def write(root):
        from library.families.sdxl.saving import write_sdxl_preset

        path = os.path.join(root, "tiny-sdxl.safetensors")
        write_sdxl_preset("tiny:sdxl", path, single_file=True)
        return path

    return tiny_store.written("tiny:sdxl file", tmp_path_factory, write)


@pytest.fixture(scope="session")
def tiny_sdxl_folder(tiny_store, tmp_path_factory) -> str:
    """tiny:sdxl as a diffusers folder (library.families.sdxl.saving.write_sdxl_preset)."""
    def write(root):
        from library.families.sdxl.saving import write_sdxl_preset

        path = os.path.join(root, "tiny-sdxl")
        write_sdxl_preset("tiny:sdxl", path)
        return path

    return tiny_store.written("tiny:sdxl folder", tmp_path_factory, write)


@pytest.fixture(scope="session")
def tiny_flux_files(tiny_store, tmp_path_factory) -> dict[str, str]:
    """tiny:flux as tools/make_tiny_model.py writes it in the BFL layout: {"transformer", "clip_l", "t5xxl", "ae"}."""
    def write(root):
        from tools.make_tiny_model import main

        assert main(["--family", "flux", "--out", root, "--single_file"]) == 0
        return root

    root = tiny_store.written("tiny:flux BFL files", tmp_path_factory, write)
    return {"transformer": os.path.join(root, "flux1-tiny.safetensors"),
            **{flag: os.path.join(root, f"{flag}.safetensors") for flag in ("clip_l", "t5xxl", "ae")}}


@pytest.fixture(scope="session")
def tiny_flux_folder(tiny_store, tmp_path_factory) -> str:
    """tiny:flux as tools/make_tiny_model.py writes it as a diffusers folder."""
    def write(root):
        from tools.make_tiny_model import main

        path = os.path.join(root, "tiny-flux")
        assert main(["--family", "flux", "--out", path]) == 0
        return path

    return tiny_store.written("tiny:flux folder", tmp_path_factory, write)


# --- data and files several test modules share ------------------------------------------------------------------

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE_IMAGES = ("blue_square", "purple_square")  # 128x128 and 192x128


@pytest.fixture(scope="module")
def example_data(tmp_path_factory):
    """Two of examples/data's images per folder, copied (--cache_latents_to_disk writes beside them) at 64 px:
    (the train folder, a dataset.toml of the same images)."""
    root = tmp_path_factory.mktemp("example-data")
    data_dir = root / "train"
    source = os.path.join(_ROOT, "examples", "data", "train")
    for folder in os.listdir(source):
        os.makedirs(data_dir / folder)
        for stem in EXAMPLE_IMAGES:
            for ext in (".png", ".txt"):
                shutil.copy(os.path.join(source, folder, stem + ext), data_dir / folder)
    subsets = "".join(f'[[datasets.subsets]]\nimage_dir = "{data_dir / name}"\nnum_repeats = 1\n'
                      for name in sorted(os.listdir(data_dir)))
    toml = root / "dataset.toml"
    toml.write_text('[general]\ncaption_extension = ".txt"\nresolution = 64\nenable_bucket = true\n'
                    f'min_bucket_reso = 64\nmax_bucket_reso = 128\n[[datasets]]\n{subsets}')
    return str(data_dir), str(toml)


@pytest.fixture(scope="module")
def hi_files(tmp_path_factory):
    """tiny:hunyuan_image as tools/make_tiny_model.py writes it: {"dit", "text_encoder", "byt5", "vae"}."""
    from library.families.hunyuan_image.loading import write_hunyuan_image_preset

    return write_hunyuan_image_preset("tiny:hunyuan_image", str(tmp_path_factory.mktemp("hunyuan-files")))


@pytest.fixture(scope="module")
def tiny_hi():
    """tiny:hunyuan_image loaded once per module (a module's own: a test may not change it)."""
    from library.families import get_family
    from library.families.base import LoadOptions

    return get_family("hunyuan_image").load(LoadOptions("tiny:hunyuan_image"))
