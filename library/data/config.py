"""The dataset TOML schema, its precedence (subset > dataset > general > CLI > default) and its checks.

`resolve_datasets(opts)` turns a dataset TOML (or, without one, the folder
flags) into fully resolved DatasetConfig / SubsetConfig objects. Every bad
value is reported at once, one line each, naming the file, the key path and
what was expected.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any, Optional

from library.core.errors import ConfigError
from library.data import schema
from library.data.captions import CaptionSettings
from library.data.folders import REPEAT_FOLDER, broken_links, find_repeat_folders
from library.data.options import RESIZE_INTERPOLATIONS, DataOptions

logger = logging.getLogger(__name__)

@dataclass
class SubsetConfig:
    """One resolved subset: a folder of images (DreamBooth), a metadata file (fine-tune) or a
    Hugging Face `datasets` dataset on disk (library/data/hf_source.py)."""

    where: str  # "datasets[0].subsets[1]" or "--train_data_dir 10_sks"
    kind: str  # "dreambooth" | "finetune" | "datasets"
    image_dir: Optional[str] = None
    metadata_file: Optional[str] = None
    dataset_name: Optional[str] = None  # kind "datasets": a save_to_disk folder, parquet/arrow file(s) or an imagefolder
    image_column: str = "image"
    caption_column: str = "text"
    dataset_split: str = "train"
    is_reg: bool = False
    class_tokens: Optional[str] = None
    caption_extension: str = ".caption"
    cache_info: bool = False
    alpha_mask: bool = False
    conditioning_data_dir: Optional[str] = None
    control_directory: Optional[str] = None  # edit training: each image's control image(s), same stem
    masked_loss: bool = False  # use the masks: conditioning_data_dir > <stem>-masklabel.png > alpha channel
    # Set for the ControlNet / LLLite scripts (DataOptions.conditioning_images): conditioning_data_dir holds the
    # RGB conditioning images, not masks.
    conditioning_images: bool = False
    unmasked_probability: float = 0.0
    unmasked_weight: float = 0.0
    normalize_masked_area_loss: bool = False
    num_repeats: int = 1
    captions: CaptionSettings = field(default_factory=CaptionSettings)
    color_aug: bool = False
    flip_aug: bool = False
    random_crop: bool = False
    face_crop_aug_range: Optional[tuple[float, float]] = None
    custom_attributes: dict = field(default_factory=dict)
    validation_split: float = 0.0
    validation_seed: Optional[int] = None
    resize_interpolation: Optional[str] = None


@dataclass
class DatasetConfig:
    """One resolved dataset: shared resolution/bucket settings and its subsets."""

    where: str
    resolutions: list[tuple[int, int]]  # (width, height); progressive: sorted low -> high
    batch_sizes: list[int]  # one per resolution
    enable_bucket: bool = False
    min_bucket_reso: int = 256
    max_bucket_reso: int = 1024
    bucket_reso_steps: int = 64
    bucket_no_upscale: bool = False
    resolution_schedule: str = "all"
    resolution_step_fractions: list[float] = field(default_factory=list)
    subsets: list[SubsetConfig] = field(default_factory=list)
    min_image_side: int = 64  # smaller images are skipped (capped at the smallest resolution side; 0 = no limit)
    max_aspect_ratio: float = 8.0  # longer side / shorter side beyond it is skipped (0 = no limit)

    @property
    def is_dreambooth(self) -> bool:
        return all(s.kind == "dreambooth" for s in self.subsets)


@dataclass
class ResolvedConfig:
    datasets: list[DatasetConfig]
    from_config_file: bool
    problems: list[str]  # data problems found while resolving (missing folders); reported with the rest
    skipped: dict[str, str] = field(default_factory=dict)  # N_name folder links that cannot be followed, with why


def _toml_repr(value: Any) -> str:
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


class _Errors:
    def __init__(self, source: str):
        self.source = source
        self.lines: list[str] = []
        self.bad_keys: set[str] = set()  # keys already reported, so a dropped value is not reported again as missing

    def add(self, where: str, message: str) -> None:
        prefix = f"{self.source}: " if self.source else ""
        self.lines.append(f"{prefix}{where}: {message}")

    def raise_if_any(self) -> None:
        if self.lines:
            raise ConfigError("\n".join(self.lines))


def _check_table(table: dict, allowed: dict[str, schema.Key], where: str, errors: _Errors,
                 extra_allowed: tuple[str, ...] = ()) -> dict[str, Any]:
    """Check every key of one TOML table; return the converted values of the keys it sets."""
    values: dict[str, Any] = {}
    for name, raw in table.items():
        path = f"{where}.{name}" if where else name
        if name in extra_allowed:
            continue
        key = allowed.get(name)
        if key is None:
            if name in schema.ALL_KEYS:
                errors.add(path, f"not allowed here ({schema.ALL_KEYS[name].where_allowed()})")
                continue
            close = difflib.get_close_matches(name, list(allowed) + list(extra_allowed), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            errors.add(path, f"unknown key{hint}")
            continue
        try:
            values[name] = key.check(raw)
        except schema.Expected as e:
            errors.add(path, f"expected {e}, got {_toml_repr(raw)}")
            errors.bad_keys.add(name)
    return values


def _cli_values(opts: DataOptions, errors: _Errors) -> dict[str, Any]:
    """The CLI layer of the precedence, converted and checked under the flag names."""
    values: dict[str, Any] = {}
    for key in schema.ALL_KEYS.values():
        if key.flag is None or not hasattr(opts, key.flag):
            continue
        raw = getattr(opts, key.flag)
        if raw is None:
            continue
        try:
            values[key.name] = key.check_cli(raw)
        except schema.Expected as e:
            errors.lines.append(f"--{key.flag}: expected {e}, got {_toml_repr(raw)}")
            errors.bad_keys.add(key.name)
    return values


def _pick(name: str, layers: list[dict[str, Any]]) -> Any:
    for layer in layers:
        if name in layer:
            return layer[name]
    return schema.ALL_KEYS[name].default


def _build_subset(where: str, kind: str, layers: list[dict[str, Any]], errors: _Errors) -> SubsetConfig:
    get = lambda name: _pick(name, layers)  # noqa: E731 - the precedence lookup, read many times below
    caption_fields = {f: get(f) for f in CaptionSettings.__dataclass_fields__}
    sub = SubsetConfig(
        where=where, kind=kind, image_dir=get("image_dir"), metadata_file=get("metadata_file"), is_reg=get("is_reg"),
        class_tokens=get("class_tokens"), caption_extension=get("caption_extension"), cache_info=get("cache_info"),
        alpha_mask=get("alpha_mask"), conditioning_data_dir=get("conditioning_data_dir"), num_repeats=get("num_repeats"),
        captions=CaptionSettings(**caption_fields), color_aug=get("color_aug"), flip_aug=get("flip_aug"),
        random_crop=get("random_crop"), face_crop_aug_range=get("face_crop_aug_range"),
        custom_attributes=get("custom_attributes") or {}, validation_split=get("validation_split"),
        validation_seed=get("validation_seed"), resize_interpolation=get("resize_interpolation"),
        dataset_name=get("dataset_name"), image_column=get("image_column"), caption_column=get("caption_column"),
        dataset_split=get("dataset_split"), masked_loss=get("masked_loss"),
        unmasked_probability=get("unmasked_probability"), unmasked_weight=get("unmasked_weight"),
        normalize_masked_area_loss=get("normalize_masked_area_loss"), control_directory=get("control_directory"),
    )
    if kind == "finetune" and sub.is_reg:
        errors.add(f"{where}.is_reg", "only DreamBooth subsets (image_dir without metadata_file) can be regularization images")
    return sub


def _build_dataset(where: str, layers: list[dict[str, Any]], subsets: list[SubsetConfig], errors: _Errors) -> DatasetConfig:
    get = lambda name: _pick(name, layers)  # noqa: E731
    resolutions = get("resolution")
    if resolutions is None:
        if "resolution" not in errors.bad_keys:
            errors.add(where, "no resolution: set resolution in the dataset config or pass --resolution")
        resolutions = [(512, 512)]
    batch = get("batch_size")
    batch_sizes = batch if isinstance(batch, list) else [batch] * len(resolutions)
    if len(batch_sizes) != len(resolutions):
        errors.add(f"{where}.batch_size", f"expected one value or {len(resolutions)} values (one per resolution), got {len(batch_sizes)}")
        batch_sizes = [batch_sizes[0]] * len(resolutions)
    ds = DatasetConfig(
        where=where, resolutions=list(resolutions), batch_sizes=list(batch_sizes), enable_bucket=get("enable_bucket"),
        min_bucket_reso=get("min_bucket_reso"), max_bucket_reso=get("max_bucket_reso"),
        bucket_reso_steps=get("bucket_reso_steps"), bucket_no_upscale=get("bucket_no_upscale"),
        resolution_schedule=get("resolution_schedule"), resolution_step_fractions=list(get("resolution_step_fractions") or []),
        subsets=subsets, min_image_side=get("min_image_side"), max_aspect_ratio=get("max_aspect_ratio"),
    )
    _check_schedule(ds, errors)
    kinds = {s.kind for s in subsets} - {"datasets"}  # a datasets subset goes with either kind
    if len(kinds) > 1:
        errors.add(where, "mixes DreamBooth subsets (image_dir) and fine-tune subsets (metadata_file); put them in separate [[datasets]]")
    return ds


def _check_schedule(ds: DatasetConfig, errors: _Errors) -> None:
    if ds.resolution_schedule != "progressive":
        if ds.resolution_step_fractions:
            errors.add(f"{ds.where}.resolution_step_fractions", 'only used with resolution_schedule = "progressive"')
        return
    n = len(ds.resolutions)
    fractions = ds.resolution_step_fractions
    if n < 2:
        errors.add(f"{ds.where}.resolution_schedule", f'"progressive" needs at least 2 resolutions, got {n}')
    elif len(fractions) != n:
        errors.add(f"{ds.where}.resolution_step_fractions", f"expected {n} fractions (one per resolution), got {len(fractions)}")
    elif abs(sum(fractions) - 1.0) > 1e-6:
        errors.add(f"{ds.where}.resolution_step_fractions", f"expected fractions that sum to 1.0, got sum {sum(fractions):.6g}")
    else:
        # Train low -> high: order resolutions (with their batch sizes) by area.
        order = sorted(range(n), key=lambda i: ds.resolutions[i][0] * ds.resolutions[i][1])
        ds.resolutions = [ds.resolutions[i] for i in order]
        ds.batch_sizes = [ds.batch_sizes[i] for i in order]


def _subset_kind(layers: list[dict[str, Any]]) -> Optional[str]:
    if _pick("dataset_name", layers):
        return "datasets"
    if _pick("metadata_file", layers):
        return "finetune"
    if _pick("image_dir", layers):
        return "dreambooth"
    return None


def load_dataset_toml(path: str) -> dict:
    """Read a dataset TOML; a missing file or bad syntax is a one-line ConfigError."""
    if not os.path.isfile(path):
        raise ConfigError(f"--dataset_config: file not found: {path}")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def resolve_from_toml(path: str, opts: DataOptions) -> ResolvedConfig:
    """Resolve a dataset TOML against the CLI values in `opts`."""
    doc = load_dataset_toml(path)
    errors = _Errors(path)
    cli = _cli_values(opts, errors)
    for name in doc:
        if name not in ("general", "datasets"):
            close = difflib.get_close_matches(name, ["general", "datasets"], n=1)
            errors.add(name, "unknown key" + (f" (did you mean {close[0]}?)" if close else "") + "; expected [general] and [[datasets]]")
    general_raw = doc.get("general", {})
    if not isinstance(general_raw, dict):
        errors.add("general", "expected a table [general]")
        general_raw = {}
    general = _check_table(general_raw, schema.GENERAL_KEYS, "general", errors)
    datasets_raw = doc.get("datasets", [])
    if not isinstance(datasets_raw, list) or not datasets_raw:
        errors.add("datasets", "expected at least one [[datasets]] table")
        datasets_raw = []
    datasets: list[DatasetConfig] = []
    for di, ds_raw in enumerate(datasets_raw):
        where = f"datasets[{di}]"
        if not isinstance(ds_raw, dict):
            errors.add(where, "expected a table [[datasets]]")
            continue
        ds_values = _check_table(ds_raw, schema.DATASET_KEYS, where, errors, extra_allowed=("subsets",))
        subsets_raw = ds_raw.get("subsets", [])
        if not isinstance(subsets_raw, list) or not subsets_raw:
            errors.add(f"{where}.subsets", "expected at least one [[datasets.subsets]] table")
            subsets_raw = []
        subsets = []
        for si, sub_raw in enumerate(subsets_raw):
            swhere = f"{where}.subsets[{si}]"
            if not isinstance(sub_raw, dict):
                errors.add(swhere, "expected a table [[datasets.subsets]]")
                continue
            sub_values = _check_table(sub_raw, schema.SUBSET_KEYS, swhere, errors)
            layers = [sub_values, ds_values, general, cli]
            kind = _subset_kind(layers)
            if kind is None:
                errors.add(swhere, "needs image_dir (DreamBooth subset), metadata_file (fine-tune subset) "
                                   "or dataset_name (a datasets folder or file)")
                continue
            if kind == "datasets":
                for other in ("image_dir", "metadata_file", "conditioning_data_dir", "control_directory"):
                    if other in sub_values:
                        errors.add(f"{swhere}.{other}", "not used with dataset_name (the images come from the dataset)")
            subsets.append(_build_subset(swhere, kind, layers, errors))
        datasets.append(_build_dataset(where, [ds_values, general, cli], subsets, errors))
    errors.raise_if_any()
    ignored = [f for f in ("train_data_dir", "reg_data_dir", "in_json") if getattr(opts, f)]
    if ignored:
        logger.warning("--dataset_config is set, so %s %s ignored", ", ".join("--" + f for f in ignored),
                       "is" if len(ignored) == 1 else "are")
    return ResolvedConfig(datasets=datasets, from_config_file=True, problems=[])


def resolve_from_flags(opts: DataOptions) -> ResolvedConfig:
    """Folder mode: --train_data_dir (N_name subfolders) + --reg_data_dir, or --in_json fine-tune metadata."""
    errors = _Errors("")
    cli = _cli_values(opts, errors)
    errors.raise_if_any()
    problems: list[str] = []
    skipped: dict[str, str] = {}
    subsets: list[SubsetConfig] = []
    if opts.in_json:
        layers = [{"metadata_file": opts.in_json, "image_dir": opts.train_data_dir, "num_repeats": opts.dataset_repeats}, cli]
        if opts.dataset_repeats < 1:
            raise ConfigError(f"--dataset_repeats: expected an integer >= 1, got {opts.dataset_repeats}")
        subsets.append(_build_subset("--in_json", "finetune", layers, errors))
    elif opts.train_data_dir:
        for flag, folder, is_reg in (("--train_data_dir", opts.train_data_dir, False),
                                     ("--reg_data_dir", opts.reg_data_dir, True)):
            if not folder:
                continue
            found, folder_problems = find_repeat_folders(folder, flag)
            problems.extend(folder_problems)
            if os.path.isdir(folder):
                skipped.update(broken_links(folder, lambda name: bool(REPEAT_FOLDER.match(name))))
            for sub_dir, repeats, class_tokens in found:
                layers = [{"image_dir": sub_dir, "num_repeats": repeats, "class_tokens": class_tokens, "is_reg": is_reg}, cli]
                subsets.append(_build_subset(f"{flag} {os.path.basename(sub_dir)}", "dreambooth", layers, errors))
    else:
        raise ConfigError("no training data: pass --dataset_config, --train_data_dir or --in_json")
    dataset = _build_dataset("command line", [cli], subsets, errors)
    errors.raise_if_any()
    return ResolvedConfig(datasets=[dataset], from_config_file=False, problems=problems, skipped=skipped)


def resolve_datasets(opts: DataOptions) -> ResolvedConfig:
    """Resolve the dataset TOML when --dataset_config is given, else the folder flags; then cross-check options."""
    resolved = resolve_from_toml(opts.dataset_config, opts) if opts.dataset_config else resolve_from_flags(opts)
    for ds in resolved.datasets:
        for sub in ds.subsets:
            sub.conditioning_images = opts.conditioning_images
    check_option_conflicts(resolved, opts)
    return resolved


def _conditioning_conflicts(sub: SubsetConfig) -> list[str]:
    """What a subset of a control script (ControlNet, LLLite) cannot have."""
    out = []
    if not sub.conditioning_data_dir:
        out.append(f"{sub.where}: needs conditioning_data_dir (a folder of conditioning images with the images' names; "
                   "--conditioning_data_dir or the subset key)")
    if sub.kind == "datasets":
        out.append(f"{sub.where}: a dataset_name subset has no conditioning images; use image_dir + conditioning_data_dir")
    if sub.face_crop_aug_range:
        out.append(f"{sub.where}: face_crop_aug_range cannot crop the conditioning image with its image; drop it")
    if sub.masked_loss:
        out.append(f"{sub.where}: masked_loss: conditioning_data_dir holds the conditioning images here, not masks; "
                   "drop masked_loss")
    return out


def check_option_conflicts(resolved: ResolvedConfig, opts: DataOptions) -> None:
    """Options that cannot work together: raise one ConfigError listing each conflict."""
    lines: list[str] = []
    for ds in resolved.datasets:
        for sub in ds.subsets:
            if opts.cache_latents or opts.cache_latents_to_disk:
                for name in ("color_aug", "random_crop"):
                    if getattr(sub, name):
                        lines.append(f"{sub.where}: {name} changes the image every step, so it cannot be used with "
                                     f"--cache_latents/--cache_latents_to_disk")
                if sub.face_crop_aug_range:
                    lines.append(f"{sub.where}: face_crop_aug_range crops randomly, so it cannot be used with --cache_latents")
            # Whether a masked_loss subset has masks at all (alpha, mask folder or -masklabel.png files) is
            # checked after discovery (library/data/mask_sources.py check_mask_sources).
            if opts.conditioning_images:
                lines.extend(_conditioning_conflicts(sub))
            elif sub.conditioning_data_dir and not sub.masked_loss:
                lines.append(f"{sub.where}: conditioning_data_dir (mask images) needs --masked_loss (or masked_loss = true)")
            if sub.resize_interpolation and sub.resize_interpolation not in RESIZE_INTERPOLATIONS:
                lines.append(f"{sub.where}: resize_interpolation: expected one of {', '.join(RESIZE_INTERPOLATIONS)}")
    if lines:
        prefix = f"{opts.dataset_config}: " if resolved.from_config_file else ""
        raise ConfigError("\n".join(prefix + line for line in lines))
