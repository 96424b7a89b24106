"""Where sample images go and what they carry: sd-scripts' file names, PNG text metadata, contact sheets.

Training samples: `<output_dir>/sample/<name>_<e000003|000500>_<NN>_<YYYYmmddHHMMSS>[_seed].png`
(the seed only when the prompt set one), and one contact sheet per sampling event,
`<output_dir>/sample/<name>_<e000003|000500>_grid.png`. Every file is written to a
temporary name and renamed, so a crash never leaves half an image.
"""

from __future__ import annotations

import math
import os
import time
from typing import Optional, Sequence

from library.core.io_utils import atomic_path

SAMPLE_DIR = "sample"


def progress_suffix(step: int, epoch: Optional[int] = None) -> str:
    """"e000003" after an epoch, "000500" after a step (sd-scripts' names)."""
    return f"e{epoch:06d}" if epoch is not None else f"{step:06d}"


def timestamp(when: Optional[float] = None) -> str:
    return time.strftime("%Y%m%d%H%M%S", time.localtime(when))


def sample_file_name(output_name: Optional[str], suffix: Optional[str], index: int, stamp: str,
                     seed: Optional[int] = None) -> str:
    """`<name>_<suffix>_<NN>_<stamp>[_<seed>].png`; no name prefix when output_name is None, as sd-scripts.

    tools/generate.py passes no suffix: `im_<NN>_<stamp>_<seed>.png`.
    """
    parts = [p for p in (output_name, suffix) if p]
    parts += [f"{index:02d}", stamp] + ([] if seed is None else [str(seed)])
    return "_".join(parts) + ".png"


def grid_file_name(output_name: Optional[str], suffix: Optional[str]) -> str:
    return "_".join([p for p in (output_name, suffix) if p] + ["grid"]) + ".png"


def png_metadata(request, extra: Optional[dict] = None) -> dict[str, str]:
    """Text chunks for one image: our own keys plus A1111's "parameters" line, which UIs read back."""
    meta = {
        "prompt": request.prompt,
        "negative_prompt": request.negative_prompt,
        "seed": str(request.seed),
        "steps": str(request.steps),
        "scale": str(request.scale),
        "sampler": str(request.sampler),
        "width": str(request.width),
        "height": str(request.height),
    }
    if request.guidance is not None:
        meta["guidance"] = str(request.guidance)
    for key, value in (extra or {}).items():
        if value is not None:
            meta[key] = str(value)
    negative = f"\nNegative prompt: {request.negative_prompt}" if request.negative_prompt else ""
    meta["parameters"] = (f"{request.prompt}{negative}\nSteps: {request.steps}, Sampler: {request.sampler}, "
                          f"CFG scale: {request.scale}, Seed: {request.seed}, Size: {request.width}x{request.height}")
    return meta


def save_png(image, path: str, text: Optional[dict[str, str]] = None) -> str:
    """Write a PNG with text chunks atomically; returns the path."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for key, value in (text or {}).items():
        info.add_itxt(key, value)  # iTXt: UTF-8, so prompts in any language survive
    with atomic_path(path) as tmp:
        image.save(tmp, format="PNG", pnginfo=info)
    return path


def read_png_text(path: str) -> dict[str, str]:
    """The text chunks of a PNG (for tests and tools)."""
    from PIL import Image

    with Image.open(path) as im:
        im.load()
        return dict(im.text)


def contact_sheet(images: Sequence, labels: Optional[Sequence[str]] = None, label_height: int = 14):
    """All images on one sheet, in rows of ceil(sqrt(n)), each cell the size of the largest image.

    Each cell gets a short label strip (e.g. the prompt number and the start of the prompt).
    """
    from PIL import Image, ImageDraw

    if not images:
        raise ValueError("contact_sheet: no images")
    cols = math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / cols)
    cell_w = max(im.width for im in images)
    cell_h = max(im.height for im in images) + (label_height if labels else 0)
    sheet = Image.new("RGB", (cols * cell_w, rows * cell_h), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for i, im in enumerate(images):
        x, y = (i % cols) * cell_w, (i // cols) * cell_h
        sheet.paste(im.convert("RGB"), (x, y))
        if labels:
            draw.text((x + 2, y + cell_h - label_height + 1), labels[i], fill=(0, 0, 0))
    return sheet


def short_label(index: int, prompt: str, width_px: int) -> str:
    """"NN prompt..." cut to fit a cell about width_px wide (the default font is ~6 px a character)."""
    text = f"{index:02d} {prompt}"
    limit = max(4, width_px // 6)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def save_samples(generated: Sequence, sample_dir: str, output_name: Optional[str], suffix: Optional[str],
                 extra: Optional[dict] = None, grid: bool = True, when: Optional[float] = None,
                 always_seed: bool = False) -> list[str]:
    """Save each GeneratedImage under sd-scripts' name and, with `grid`, one contact sheet; returns the paths.

    The seed is in a file name when the user chose it, or always with `always_seed` (tools/generate.py).
    """
    os.makedirs(sample_dir, exist_ok=True)
    stamp = timestamp(when)
    paths = []
    for g in generated:
        r = g.request
        name = sample_file_name(output_name, suffix, r.index, stamp, r.seed if r.seed_given or always_seed else None)
        paths.append(save_png(g.image, os.path.join(sample_dir, name), png_metadata(r, extra)))
    if grid and generated:
        labels = [short_label(g.request.index, g.request.prompt, g.image.width) for g in generated]
        sheet = contact_sheet([g.image for g in generated], labels)
        paths.append(save_png(sheet, os.path.join(sample_dir, grid_file_name(output_name, suffix)),
                              {"prompts": "\n".join(g.request.prompt for g in generated), **extra_text(extra)}))
    return paths


def extra_text(extra: Optional[dict]) -> dict[str, str]:
    return {k: str(v) for k, v in (extra or {}).items() if v is not None}
