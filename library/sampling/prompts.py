"""Sample prompt files: .txt (one prompt a line), .toml ([prompt] defaults + [[prompt.subset]]) and .json.

The formats and the inline options (` --n`, `--w`, `--h`, `--d`, `--s`, `--l`,
`--g`, `--ss`) are those of sd-scripts; `--ci PATH` (one per control image of an edit model) is
musubi-tuner's. Unlike sd-scripts, an unknown option or
a bad number is an error naming the file and line, raised when the file is read
(before training starts), not a message lost in the log of a long run.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from library.core.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass
class SamplePrompt:
    """One prompt and its own settings; None means "the default" (flag or family default)."""

    prompt: str
    negative_prompt: str = ""
    width: Optional[int] = None
    height: Optional[int] = None
    seed: Optional[int] = None
    steps: Optional[int] = None
    scale: Optional[float] = None  # classifier-free guidance (CFG) scale
    guidance: Optional[float] = None  # Flux's distilled guidance (--g)
    sampler: Optional[str] = None
    control_images: tuple[str, ...] = ()  # edit models' reference image(s) (--ci, repeatable; musubi-tuner's name)
    control_image: Optional[str] = None  # --cn / controlnet_image: the ControlNet's conditioning image
    index: int = 0  # position in the file: the NN of the sample file name
    ignored: dict[str, Any] = field(default_factory=dict)  # sd-scripts options we accept but do not use


def _text(text: str) -> str:
    return text


# Inline option -> (SamplePrompt field, converter, what the user must write)
INLINE_OPTIONS: dict[str, tuple[str, Callable[[str], Any], str]] = {
    "n": ("negative_prompt", _text, "a negative prompt"),
    "w": ("width", int, "an integer width in pixels"),
    "h": ("height", int, "an integer height in pixels"),
    "d": ("seed", int, "an integer seed"),
    "s": ("steps", int, "an integer number of steps"),
    "l": ("scale", float, "a number (CFG scale)"),
    "g": ("guidance", float, "a number (guidance)"),
    "ss": ("sampler", _text, "a sampler name"),
    "ci": ("control_images", _text, "a control image file"),  # repeatable: one --ci per image
    "cn": ("control_image", _text, "a control image file"),
}
# sd-scripts options for CFG truncation, CFG renormalisation and flow shift, and gen_img's per-prompt network
# multipliers (--am, used by tools/generate.py): accepted so an existing file keeps working, reported as unused
# where nothing reads them.
IGNORED_INLINE = ("ctr", "rcfg", "fs", "am")

# Keys of a .toml / .json prompt entry -> SamplePrompt field (sd-scripts' names).
DICT_KEYS: dict[str, tuple[str, Callable[[Any], Any], str]] = {
    "prompt": ("prompt", str, "a string"),
    "negative_prompt": ("negative_prompt", str, "a string"),
    "width": ("width", int, "an integer"),
    "height": ("height", int, "an integer"),
    "seed": ("seed", int, "an integer"),
    "sample_steps": ("steps", int, "an integer"),
    "scale": ("scale", float, "a number"),
    "guidance_scale": ("guidance", float, "a number"),
    "sample_sampler": ("sampler", str, "a string"),
    "control_image": ("control_images", str, "a file name or a list of them"),
    "controlnet_image": ("control_image", str, "a string"),
}
IGNORED_KEYS = ("cfg_trunc_ratio", "renorm_cfg", "flow_shift", "enum")
POSITIVE_FIELDS = ("width", "height", "steps")


def parse_prompt_line(line: str, where: str, index: int = 0) -> SamplePrompt:
    """Parse `prompt text --n negative --w 512 --d 42 ...`; errors name `where` (e.g. "p.txt:3")."""
    parts = (" " + line).split(" --")  # the leading space lets a line start with an option
    prompt = SamplePrompt(prompt=parts[0].strip(), index=index)
    for part in parts[1:]:
        name, _, value = part.strip().partition(" ")
        name = name.lower()  # sd-scripts matches options case-insensitively
        value = value.strip()
        if name in IGNORED_INLINE:
            prompt.ignored[name] = value
            continue
        if name not in INLINE_OPTIONS:
            known = ", ".join("--" + k for k in INLINE_OPTIONS)
            raise ConfigError(f"{where}: unknown option --{name}; expected one of {known}")
        attr, convert, expected = INLINE_OPTIONS[name]
        if not value and attr != "negative_prompt":
            raise ConfigError(f"{where}: --{name}: expected {expected}, got nothing")
        if attr == "control_images":
            prompt.control_images += (value,)
            continue
        try:
            setattr(prompt, attr, convert(value))
        except ValueError:
            raise ConfigError(f"{where}: --{name}: expected {expected}, got {value!r}") from None
    _check_ranges(prompt, where, inline=True)
    if not prompt.prompt:
        raise ConfigError(f"{where}: the prompt is empty (only options)")
    return prompt


def prompt_from_dict(entry: dict, where: str, index: int = 0) -> SamplePrompt:
    """A .toml / .json entry (sd-scripts' keys: prompt, negative_prompt, width, sample_steps, ...)."""
    prompt = SamplePrompt(prompt="", index=index)
    for key, value in entry.items():
        if key in IGNORED_KEYS:
            if key != "enum":
                prompt.ignored[key] = value
            continue
        if key not in DICT_KEYS:
            raise ConfigError(f"{where}: unknown key {key!r}; expected one of {', '.join(DICT_KEYS)}")
        attr, convert, expected = DICT_KEYS[key]
        if attr == "control_images":
            names = [value] if isinstance(value, str) else value
            if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
                raise ConfigError(f"{where}: {key}: expected {expected}, got {value!r}")
            prompt.control_images = tuple(names)
            continue
        ok = isinstance(value, str) if convert is str else (
            isinstance(value, (int, float)) and not isinstance(value, bool)
            and (convert is float or float(value).is_integer()))
        if not ok:
            raise ConfigError(f"{where}: {key}: expected {expected}, got {value!r}")
        setattr(prompt, attr, convert(value))
    if not prompt.prompt.strip():
        raise ConfigError(f"{where}: prompt: expected a non-empty string")
    _check_ranges(prompt, where, inline=False)
    return prompt


def _check_ranges(prompt: SamplePrompt, where: str, inline: bool) -> None:
    names = {"width": "--w", "height": "--h", "steps": "--s"} if inline else \
        {"width": "width", "height": "height", "steps": "sample_steps"}
    for attr in POSITIVE_FIELDS:
        value = getattr(prompt, attr)
        if value is not None and value < 1:
            raise ConfigError(f"{where}: {names[attr]}: expected an integer >= 1, got {value}")
    for path in prompt.control_images:  # named now, not when the sample is due
        if not os.path.isfile(path):
            raise ConfigError(f"{where}: {'--ci' if inline else 'control_image'} {path}: file not found")
    if prompt.scale is not None and prompt.scale < 0:
        raise ConfigError(f"{where}: {'--l' if inline else 'scale'}: expected a number >= 0, got {prompt.scale}")


def load_prompts(path: str, check_sampler: Optional[Callable[[str], Any]] = None,
                 used: tuple[str, ...] = ()) -> list[SamplePrompt]:
    """Read a prompt file (.txt, .toml or .json) into SamplePrompts, numbered in file order.

    `check_sampler(name)` (e.g. samplers.canonical_sampler) validates each `--ss` /
    `sample_sampler` so a typo is reported now, with its line. `used`: options of
    IGNORED_INLINE that the caller reads from `SamplePrompt.ignored` (not reported as unused).
    """
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: file not found")
    ext = os.path.splitext(path)[1].lower()
    readers = {".txt": _read_txt, ".toml": _read_toml, ".json": _read_json}
    if ext not in readers:
        raise ConfigError(f"{path}: expected a .txt, .toml or .json prompt file, got {ext or 'no extension'!r}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    entries = readers[ext](text, path)
    prompts = []
    for index, (where, entry) in enumerate(entries):
        prompt = parse_prompt_line(entry, where, index) if isinstance(entry, str) else \
            prompt_from_dict(entry, where, index)
        if check_sampler is not None and prompt.sampler is not None:
            try:
                check_sampler(prompt.sampler)
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}") from None
        unused = [k for k in prompt.ignored if k not in used]
        if unused:
            logger.warning("%s: options not supported here and ignored: %s", where, ", ".join(unused))
        prompts.append(prompt)
    if not prompts:
        raise ConfigError(f"{path}: no prompts in the file")
    return prompts


def _read_txt(text: str, name: str) -> list[tuple[str, Any]]:
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if line and not line.startswith("#"):
            out.append((f"{name}:{number}", line))
    return out


def _read_toml(text: str, name: str) -> list[tuple[str, Any]]:
    import toml

    try:
        data = toml.loads(text)
    except toml.TomlDecodeError as e:
        raise ConfigError(f"{name}:{e.lineno}: not valid TOML ({e.msg})") from None
    section = data.get("prompt")
    if not isinstance(section, dict):
        raise ConfigError(f"{name}: expected a [prompt] table with [[prompt.subset]] entries")
    subsets = section.get("subset", [])
    if not isinstance(subsets, list) or not all(isinstance(s, dict) for s in subsets):
        raise ConfigError(f"{name}: prompt.subset: expected [[prompt.subset]] tables")
    defaults = {k: v for k, v in section.items() if k != "subset"}
    # TOML parsers give no line numbers for tables, so entries are named by position.
    return [(f"{name}: prompt.subset[{i}]", {**defaults, **subset}) for i, subset in enumerate(subsets)]


def _read_json(text: str, name: str) -> list[tuple[str, Any]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{name}:{e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(data, list):
        raise ConfigError(f"{name}: expected a JSON list of prompts (strings or objects)")
    out = []
    for i, entry in enumerate(data):
        if not isinstance(entry, (str, dict)):
            raise ConfigError(f"{name}: [{i}]: expected a string or an object, got {type(entry).__name__}")
        out.append((f"{name}: [{i}]", entry))
    return out

