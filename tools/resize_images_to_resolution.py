"""Resize a folder's images to at most each of several pixel areas (sd-scripts' tools/resize_images_to_resolution.py).

    python tools/resize_images_to_resolution.py src_dir dst_dir --max_resolution 512x512,384x384 \\
        [--divisible_by 8] [--interpolation area] [--save_as_png] [--copy_associated_files]

For each image and each `WxH` in --max_resolution, an image with more than W·H pixels is scaled down
(aspect kept) to at most W·H pixels, then centre-cropped so both sides divide by --divisible_by, and saved
as `<name>+<WxH>.jpg` (quality 100) or `.png`. Files that are not images (captions, ...) are copied to
dst_dir as they are; with --copy_associated_files, `<name>.<ext>` is also copied as `<name>+<WxH>.<ext>` for
each resolution.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

INTERPOLATION_CHOICES = ("area", "cubic", "lanczos4", "nearest", "linear", "box")
_OURS = {"lanczos4": "lanczos"}  # sd-scripts' cv2 names -> library/data/images.py INTERPOLATIONS


def setup_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src_img_folder", type=str, help="source folder containing the images")
    p.add_argument("dst_img_folder", type=str, help="destination folder for the resized images")
    p.add_argument("--max_resolution", type=str, default="512x512,384x384,256x256,128x128",
                   help='maximum resolution(s) as "512x512,384x384" (pixel areas; the aspect ratio is kept)')
    p.add_argument("--divisible_by", type=int, default=1, help="crop each side to a multiple of this")
    p.add_argument("--interpolation", type=str, choices=INTERPOLATION_CHOICES, default=None,
                   help="resize filter (default: area when shrinking)")
    p.add_argument("--save_as_png", action="store_true", help="save as .png (default .jpg, quality 100)")
    p.add_argument("--copy_associated_files", action="store_true",
                   help="also copy files with an image's base name (captions, ...) once per resolution")
    return p


def parse_resolutions(text: str) -> list[tuple[int, int, str]]:
    """`512x512,384x384` -> [(512, 512, "512x512"), ...]; a one-line UserError for anything else."""
    from library.core.errors import UserError

    out = []
    for part in (p.strip() for p in text.split(",")):
        w, sep, h = part.partition("x")
        if not sep or not w.isdigit() or not h.isdigit() or int(w) < 1 or int(h) < 1:
            raise UserError(f"--max_resolution: expected WIDTHxHEIGHT values like 512x512,384x384, got {part!r}")
        out.append((int(w), int(h), part))
    return out


def target_size(width: int, height: int, max_pixels: int, divisible_by: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized w, h), (cropped w, h)): scaled to at most max_pixels (sd-scripts' int(side·√(max/current))),
    then each side rounded down to a multiple of divisible_by."""
    if width * height > max_pixels:
        factor = math.sqrt(max_pixels / (width * height))
        width, height = int(width * factor), int(height * factor)
    crop = (width - width % divisible_by, height - height % divisible_by)
    return (width, height), crop


def _check(args) -> list[tuple[int, int, str]]:
    from library.core.errors import UserError

    src, dst = args.src_img_folder, args.dst_img_folder
    if not os.path.isdir(src):
        raise UserError(f"{src}: not a folder (expected the folder of images to resize)")
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise UserError(f"{dst}: exists and is not a folder")
    if os.path.isdir(dst) and os.path.samefile(src, dst):
        raise UserError(f"{dst}: the destination must differ from the source folder")
    if args.divisible_by < 1:
        raise UserError(f"--divisible_by: expected an integer >= 1, got {args.divisible_by}")
    resolutions = parse_resolutions(args.max_resolution)
    _check_images(src, resolutions, args.divisible_by)
    return resolutions


def _check_images(src: str, resolutions: list[tuple[int, int, str]], divisible_by: int) -> None:
    """Every image's header readable and every output at least 1x1, before anything is written."""
    from PIL import Image

    from library.core.errors import UserError
    from library.data.images import is_image_file

    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if not (os.path.isfile(path) and is_image_file(name)):
            continue
        try:
            with Image.open(path) as img:
                width, height = img.size
        except Exception as e:  # PIL raises UnidentifiedImageError, OSError, SyntaxError, ...
            raise UserError(f"{path}: not a readable image ({str(e).splitlines()[0] if str(e) else type(e).__name__})") \
                from None
        for w, h, label in resolutions:
            _, (cw, ch) = target_size(width, height, w * h, divisible_by)
            if cw < 1 or ch < 1:
                raise UserError(f"{path}: {width}x{height} leaves nothing at {label} with --divisible_by "
                                f"{divisible_by}")


def _atomic_copy(src: str, dst: str) -> None:
    from library.core.io_utils import atomic_path

    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)


def _save(image, path: str, png: bool) -> None:
    from PIL import Image

    from library.core.io_utils import atomic_path

    with atomic_path(path) as tmp:
        if png:
            Image.fromarray(image).save(tmp, format="PNG")
        else:
            Image.fromarray(image).save(tmp, format="JPEG", quality=100)


def resize_images(src: str, dst: str, resolutions: list[tuple[int, int, str]], divisible_by: int = 1,
                  interpolation: Optional[str] = None, save_as_png: bool = False,
                  copy_associated_files: bool = False) -> list[str]:
    """Write every output (see the module doc); returns the names written, in order."""
    from library.data.images import is_image_file, load_image, resize_image

    names = sorted(n for n in os.listdir(src) if os.path.isfile(os.path.join(src, n)))
    images = [n for n in names if is_image_file(n)]
    others = [n for n in names if not is_image_file(n)]
    os.makedirs(dst, exist_ok=True)
    written = []
    for name in others:
        _atomic_copy(os.path.join(src, name), os.path.join(dst, name))
        written.append(name)
    filter_name = _OURS.get(interpolation, interpolation)
    from tqdm import tqdm

    for name in tqdm(images, desc="resizing", unit="img", disable=len(images) < 2):
        rgb, _ = load_image(os.path.join(src, name))  # EXIF orientation applied; transparency onto white
        base = os.path.splitext(name)[0]
        for _w, _h, label in resolutions:
            h0, w0 = rgb.shape[:2]
            (w, h), (cw, ch) = target_size(w0, h0, _w * _h, divisible_by)
            out = resize_image(rgb, (w, h), filter_name)
            y, x = (h - ch) // 2, (w - cw) // 2
            out = out[y:y + ch, x:x + cw]
            out_name = f"{base}+{label}{'.png' if save_as_png else '.jpg'}"
            _save(out, os.path.join(dst, out_name), save_as_png)
            written.append(out_name)
            tqdm.write(f"{'Resized' if (w, h) != (w0, h0) else 'Saved'} image: {name} with size {ch}x{cw} as "
                       f"{out_name}")
        if copy_associated_files:
            for other in others:
                stem, ext = os.path.splitext(other)
                if stem == base:
                    for _w, _h, label in resolutions:
                        _atomic_copy(os.path.join(src, other), os.path.join(dst, f"{base}+{label}{ext}"))
                        written.append(f"{base}+{label}{ext}")
    return written


def run(argv=None) -> None:
    args = setup_parser().parse_args(argv)
    resolutions = _check(args)
    resize_images(args.src_img_folder, args.dst_img_folder, resolutions, args.divisible_by, args.interpolation,
                  args.save_as_png, args.copy_associated_files)


def main(argv=None) -> int:
    from library.core.errors import run_tool

    return run_tool(run, argv)


if __name__ == "__main__":
    sys.exit(main())
