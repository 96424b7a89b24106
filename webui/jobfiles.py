"""A job's folder: `<jobs_dir>/<id>/` with config.toml (the trainer's --config_file), dataset.toml
(its --dataset_config), prompts.txt (its --sample_prompts, when there are prompts), train.log, exit_code
and output/ (the run's --output_dir). Templates per family x mode are TOML files in webui/templates/."""

from __future__ import annotations

import copy
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Iterator, Optional

import toml

from library.core.io_utils import atomic_write_text

TEMPLATES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {
    ("sd", "lora"): "train_network.py", ("sd", "finetune"): "fine_tune.py", ("sd", "dreambooth"): "train_db.py",
    ("sdxl", "lora"): "sdxl_train_network.py", ("sdxl", "finetune"): "sdxl_train.py",
    ("flux", "lora"): "flux_train_network.py", ("flux", "finetune"): "flux_train.py",
    ("sd3", "lora"): "sd3_train_network.py", ("sd3", "finetune"): "sd3_train.py",
    ("anima", "lora"): "anima_train_network.py", ("anima", "finetune"): "anima_train.py",
    # Chroma trains through the FLUX.1 scripts, told by model_type = "chroma" in config.toml (MODEL_TYPES)
    ("chroma", "lora"): "flux_train_network.py", ("chroma", "finetune"): "flux_train.py",
    ("lumina", "lora"): "lumina_train_network.py", ("lumina", "finetune"): "lumina_train.py",
    ("zimage", "lora"): "zimage_train_network.py", ("zimage", "finetune"): "zimage_train.py",
    ("hunyuan_image", "lora"): "hunyuan_image_train_network.py",  # sd-scripts has no HunyuanImage fine-tune script
}
# The --model_type a job of a family that shares its scripts must have (None: the scripts' default, flux).
MODEL_TYPES = {"flux": (None, "flux"), "chroma": ("chroma",)}
# Keys the UI sets itself, pointing into the job's folder (a value given for them is replaced).
MANAGED_KEYS = ("output_dir", "logging_dir", "dataset_config", "sample_prompts", "config_file")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
EVENT_FILE_PREFIX = "events.out.tfevents."
_NO_FOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


class PlantedLink(OSError):
    """A symbolic link where the job's folder, output/ or output/logs/ should be: the UI never follows it."""


def open_for_append(path: str):
    """`path` opened to append bytes (train.log, tensorboard.log), never through a symbolic link: a link there
    is not the UI's and is replaced by the file (O_NOFOLLOW: one planted meanwhile raises, is not followed)."""
    if os.path.islink(path):
        os.unlink(path)
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666), "ab")


class SettingsError(ValueError):
    """A setting the trainer's own check refused: its one-line error and the flag or key it names."""

    def __init__(self, message: str, field: Optional[str], where: Optional[str] = None):
        super().__init__(message)
        self.field = field
        self.where = where  # the dataset table of a dataset.toml error: "datasets[0].subsets[1]"


def templates() -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted(glob.glob(os.path.join(TEMPLATES_DIR, "*.toml"))):
        name = os.path.splitext(os.path.basename(path))[0]
        data = toml.load(path)
        data.setdefault("config", {})
        data.setdefault("dataset", {})
        out[name] = data
    return out


def script_for(family: str, mode: str) -> str:
    return SCRIPTS[(family, mode)]


def model_type_refusal(family: str, config: dict) -> Optional[tuple[str, str]]:
    """(one-line error, field) when config.toml's model_type is not the job family's (a Chroma job without
    model_type = "chroma" would train FLUX.1 with the same script), else None."""
    allowed = MODEL_TYPES.get(family)
    if allowed is None:
        return None
    section = find_key(config, "model_type")
    value = None if section is None else (config if section == "" else config[section])["model_type"]
    value = None if value == "" else value  # a blank field is no value
    if value in allowed:
        return None
    want = " or ".join("blank" if a is None else f'"{a}"' for a in allowed)
    got = "blank" if value is None else f'"{value}"' if isinstance(value, str) else repr(value)
    return (f"model_type: a {family} job needs model_type {want} (the FLUX.1 scripts train the model it names), "
            f"got {got}"), "model_type"


def find_key(config: dict, key: str) -> Optional[str]:
    """The section of `config` holding `key` ("" for a top-level key), or None."""
    if key in config and not isinstance(config[key], dict):
        return ""
    for section, values in config.items():
        if isinstance(values, dict) and key in values:
            return section
    return None


def _drop_key(config: dict, key: str) -> None:
    section = find_key(config, key)
    while section is not None:
        (config if section == "" else config[section]).pop(key)
        section = find_key(config, key)


class JobFolder:
    def __init__(self, jobs_dir: str, job_id: int):
        self.path = os.path.join(os.path.abspath(jobs_dir), str(int(job_id)))
        self.config_path = os.path.join(self.path, "config.toml")
        self.dataset_path = os.path.join(self.path, "dataset.toml")
        self.prompts_path = os.path.join(self.path, "prompts.txt")
        self.launch_path = os.path.join(self.path, "launch.toml")  # GPUs and strategy: the UI's own file
        self.accelerate_config_path = os.path.join(self.path, "accelerate_config.yaml")
        self.log_path = os.path.join(self.path, "train.log")
        self.exit_code_path = os.path.join(self.path, "exit_code")
        self.output_dir = os.path.join(self.path, "output")

    # --- settings -------------------------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        config = toml.load(self.config_path) if os.path.isfile(self.config_path) else {}
        dataset = toml.load(self.dataset_path) if os.path.isfile(self.dataset_path) else {}
        prompts = []
        if os.path.isfile(self.prompts_path):
            with open(self.prompts_path, encoding="utf-8") as f:
                prompts = [line.rstrip("\n") for line in f if line.strip() and not line.startswith("#")]
        for key in MANAGED_KEYS:
            _drop_key(config, key)
        launch = toml.load(self.launch_path) if os.path.isfile(self.launch_path) else {}
        return {"config": _drop_empty(config), "dataset": dataset, "prompts": prompts, "launch": launch}

    def files_for(self, settings: dict[str, Any], config_path: str, dataset_path: str,
                  prompts_path: str) -> tuple[str, str, Optional[str]]:
        """The texts of config.toml, dataset.toml and prompts.txt for `settings` (the managed keys added)."""
        config = _drop_empty(copy.deepcopy(settings.get("config") or {}))
        for key in MANAGED_KEYS:
            _drop_key(config, key)
        output = config.setdefault("output", {})
        output["output_dir"] = self.output_dir
        output["logging_dir"] = os.path.join(self.output_dir, "logs")
        config.setdefault("dataset", {})["dataset_config"] = dataset_path
        prompts = [p.replace("\n", " ").strip() for p in settings.get("prompts") or [] if p and p.strip()]
        if prompts:
            config.setdefault("sampling", {})["sample_prompts"] = prompts_path
        return toml.dumps(config), toml.dumps(settings.get("dataset") or {}), \
            ("\n".join(prompts) + "\n" if prompts else None)

    def write_settings(self, settings: dict[str, Any]) -> None:
        config, dataset, prompts = self.files_for(settings, self.config_path, self.dataset_path, self.prompts_path)
        atomic_write_text(self.dataset_path, dataset)
        if prompts is None:
            if os.path.exists(self.prompts_path):
                os.remove(self.prompts_path)
        else:
            atomic_write_text(self.prompts_path, prompts)
        atomic_write_text(self.config_path, config)
        atomic_write_text(self.launch_path, toml.dumps(settings.get("launch") or {}))

    def check_settings(self, settings: dict[str, Any], script: str, timeout: float = 180) -> None:
        """Run the trainer's own parser and checks (`<script> --config_file ... --check_config`) on the
        settings, written to a scratch folder of the job. Raises SettingsError with its one-line error."""
        os.makedirs(self.path, exist_ok=True)
        scratch = tempfile.mkdtemp(prefix=".check-", dir=self.path)  # a new folder: nothing planted to follow
        paths = [os.path.join(scratch, n) for n in ("config.toml", "dataset.toml", "prompts.txt")]
        try:
            texts = self.files_for(settings, *paths)
        except (TypeError, ValueError) as e:
            raise SettingsError(f"cannot write the settings as TOML: {e}", None) from None
        for path, text in zip(paths, texts):
            if text is not None:
                atomic_write_text(path, text)
        try:
            result = subprocess.run([sys.executable, script, "--config_file", paths[0], "--check_config"],
                                    cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                                    env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdin=subprocess.DEVNULL)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if result.returncode == 0:
            return
        message = one_line_error(result.stderr)
        for path, name in zip(paths, ("config.toml", "dataset.toml", "prompts.txt")):
            message = message.replace(path, name)
        raise SettingsError(message, error_field(message), error_where(message))

    # --- files --------------------------------------------------------------------------------------
    def planted_link(self) -> Optional[str]:
        """The first of the job's folder, output/ and output/logs/ that is a symbolic link (the UI makes none:
        runs, TensorBoard and deletions must not write or delete through one), else None."""
        for path in (self.path, self.output_dir, os.path.join(self.output_dir, "logs")):
            if os.path.islink(path):
                return path
        return None

    def resolve(self, relative: str) -> Optional[str]:
        """`relative` inside the job folder after symlinks, or None when it points outside (or has a NUL)."""
        if "\0" in relative:
            return None
        root = os.path.realpath(self.path)
        target = os.path.realpath(os.path.join(root, relative))
        return target if target == root or target.startswith(root + os.sep) else None

    def sample_images(self) -> list[dict[str, Any]]:
        """The sample images, newest first, each labelled for the gallery: `step` (or `epoch`) and `prompt_index`
        from sd-scripts' name `<name>_<000500|e000003>_<NN>_<stamp>[_seed].png`, `prompt` from the PNG's text,
        `grid` for the step's grid image, `generated` for tools/generate.py's `im_<NN>_<stamp>_<seed>.png`."""
        out = []
        for folder, _, files in os.walk(self.output_dir):
            if os.path.basename(folder) != "sample":
                continue
            for name in files:
                if name.lower().endswith(IMAGE_EXTENSIONS):
                    full = os.path.join(folder, name)
                    out.append({"path": os.path.relpath(full, self.path), "name": name,
                                "mtime": os.path.getmtime(full), **sample_label(full)})
        return sorted(out, key=lambda s: s["mtime"], reverse=True)

    def has_state(self) -> bool:
        """Whether a run saved a training state here (output/*-state): Start resumes from it."""
        try:
            return any(e.name.endswith("-state") and e.is_dir(follow_symlinks=False) for e in os.scandir(self.output_dir))
        except OSError:
            return False

    def trained_files(self) -> list[dict[str, Any]]:
        """The models the runs saved (files in output/, newest first), for download."""
        out = []
        if os.path.isdir(self.output_dir):
            for name in os.listdir(self.output_dir):
                full = os.path.join(self.output_dir, name)
                if name.endswith((".safetensors", ".ckpt", ".pt")) and os.path.isfile(full) and not name.startswith("."):
                    out.append({"path": os.path.relpath(full, self.path), "name": name,
                                "size": os.path.getsize(full), "mtime": os.path.getmtime(full)})
        return sorted(out, key=lambda s: s["mtime"], reverse=True)

    def delete_event_files(self) -> int:
        """Remove the TensorBoard event files under output/logs/ (nothing else); returns how many.

        Never through a symbolic link: the folders are opened with O_NOFOLLOW relative to their parent's
        descriptor, so a link at the job's folder, output/ or output/logs/ raises PlantedLink, a link below is
        not descended, and a link named like an event file is left alone (not a regular file)."""
        fds = []
        try:
            logs_dir = os.path.join(self.output_dir, "logs")
            for name, full in ((self.path, self.path), ("output", self.output_dir), ("logs", logs_dir)):
                try:
                    fds.append(os.open(name, _NO_FOLLOW_DIR, dir_fd=fds[-1] if fds else None))
                except FileNotFoundError:
                    return 0
                except OSError as e:  # ELOOP: a symbolic link; ENOTDIR: a file
                    raise PlantedLink(f"{full}: not a folder of the job's own ({e.strerror}): not followed, "
                                      "nothing deleted") from None
            return sum(1 for _ in _remove_event_files(fds[-1]))
        finally:
            for fd in fds:
                os.close(fd)


def _remove_event_files(dir_fd: int) -> Iterator[str]:
    """Unlink the regular files named events.out.tfevents.* in the folder open as `dir_fd` and its real
    subfolders (each opened with O_NOFOLLOW relative to its parent); yields each name removed."""
    with os.scandir(dir_fd) as entries:
        entries = list(entries)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            try:
                fd = os.open(entry.name, _NO_FOLLOW_DIR, dir_fd=dir_fd)
            except OSError:  # replaced by a link (or removed) since the listing: not followed
                continue
            try:
                yield from _remove_event_files(fd)
            finally:
                os.close(fd)
        elif entry.name.startswith(EVENT_FILE_PREFIX) and entry.is_file(follow_symlinks=False):
            os.unlink(entry.name, dir_fd=dir_fd)
            yield entry.name


_SAMPLE_RE = re.compile(r"_(e?)(\d{6})_(\d{2})_\d{14}(?:_\d+)?\.png$")
_GRID_RE = re.compile(r"_(e?)(\d{6})_grid\.png$")
_GENERATED_RE = re.compile(r"^im_(\d{2,})_\d{14}(?:_\d+)?\.png$")


def sample_label(path: str) -> dict[str, Any]:
    """Step or epoch, prompt index and prompt of one sample image (see JobFolder.sample_images)."""
    name = os.path.basename(path)
    label: dict[str, Any] = {"step": None, "epoch": None, "prompt_index": None, "prompt": None, "grid": False,
                             "generated": False}
    m = _SAMPLE_RE.search(name) or _GRID_RE.search(name)
    if m:
        label["epoch" if m.group(1) else "step"] = int(m.group(2))
        if m.re is _GRID_RE:
            label["grid"] = True
        else:
            label["prompt_index"] = int(m.group(3))
    else:
        g = _GENERATED_RE.match(name)
        if g:
            label["generated"], label["prompt_index"] = True, int(g.group(1))
    if not label["grid"] and name.lower().endswith(".png"):
        label["prompt"] = png_prompt(path)
    return label


def png_prompt(path: str) -> Optional[str]:
    """The `prompt` text chunk of a PNG the sampler wrote (read with the standard library), or None."""
    import zlib

    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except OSError:
        return None
    pos = 8
    while pos + 8 <= len(data):
        length = int.from_bytes(data[pos:pos + 4], "big")
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if kind in (b"tEXt", b"iTXt") and body.startswith(b"prompt\0"):
            rest = body[len(b"prompt\0"):]
            if kind == b"iTXt":  # compression flag, method, language\0, translated keyword\0, text
                compressed = rest[:1] == b"\1"
                rest = rest[2:].split(b"\0", 2)[-1]
                if compressed:
                    try:
                        rest = zlib.decompress(rest)
                    except zlib.error:
                        return None
            return rest.decode("utf-8", errors="replace")
        if kind == b"IDAT":
            break
        pos += 12 + length
    return None


def _drop_empty(config: dict) -> dict:
    """Blank form fields are no value (TOML has no null)."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            value = _drop_empty(value)
            if value:
                out[key] = value
        elif value is not None and value != "":
            out[key] = value
    return out


def one_line_error(stderr: str) -> str:
    """The trainer's `error: ...` line (an error naming several config keys: its lines joined with '; ')."""
    lines = stderr.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("error: "):
            more = []
            for follow in lines[i + 1:]:
                if not follow.strip() or follow.startswith(("INFO", "WARNING", "DEBUG", "Traceback", " ")):
                    break
                more.append(follow.strip())
            return "; ".join([line[len("error: "):]] + more[:9])
    return next((line for line in reversed(lines) if line.strip()), "the check failed without a message")


_FLAG_RE = re.compile(r"--([A-Za-z0-9_]+)")
_KEY_RE = re.compile(r"^(?:config|dataset)\.toml: (?:[A-Za-z0-9_]+\.|datasets\[\d+\](?:\.subsets\[\d+\])?(?:\.|: ))*"
                     r"([A-Za-z0-9_]+)(?::|$| )")


_WHERE_RE = re.compile(r"^dataset\.toml: (datasets\[\d+\](?:\.subsets\[\d+\])?|general)")


def error_where(message: str) -> Optional[str]:
    """The dataset.toml table an error is about: `dataset.toml: datasets[0].subsets[1].num_repeats: ...` ->
    datasets[0].subsets[1]; None for other errors."""
    m = _WHERE_RE.match(message)
    return m.group(1) if m else None


def error_field(message: str) -> Optional[str]:
    """The flag or key a one-line error is about: `--learning_rate -1: ...` -> learning_rate;
    `config.toml: optimizer.learnig_rate: unknown flag` -> learnig_rate; dataset keys likewise."""
    m = _KEY_RE.match(message)
    if m:
        return m.group(1)
    m = _FLAG_RE.search(message)
    return m.group(1) if m else None
