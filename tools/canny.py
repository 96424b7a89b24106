"""Canny edges of an image: the conditioning image of a canny ControlNet (sd-scripts' tools/canny.py: the same
flags and thresholds; OpenCV's Canny on the greyscale image, white edges on black).

    python tools/canny.py --input photo.png --output cond/photo.png --thres1 32 --thres2 224

With --input and --output folders, every image of the folder gets its edges under the same name (the layout the
ControlNet scripts' --conditioning_data_dir expects). Needs opencv-python-headless (requirements-dev.txt).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="an image, or a folder of images")
    p.add_argument("--output", required=True, help="the edge image to write (a folder when --input is one)")
    p.add_argument("--thres1", type=int, default=32, help="Canny's lower hysteresis threshold (default 32)")
    p.add_argument("--thres2", type=int, default=224, help="Canny's upper hysteresis threshold (default 224)")
    return p


def canny(image_path: str, output_path: str, thres1: int, thres2: int) -> None:
    """Write the Canny edges of `image_path` to `output_path` (atomically; the format from its extension)."""
    import cv2
    import numpy as np

    from library.core.io_utils import atomic_path

    data = np.fromfile(image_path, dtype=np.uint8)  # not cv2.imread: it cannot read non-ASCII paths on Windows
    img = cv2.imdecode(data, cv2.IMREAD_GRAYSCALE) if data.size else None
    if img is None:
        raise ValueError(f"{image_path}: not an image OpenCV can read")
    edges = cv2.Canny(img, thres1, thres2)
    ext = os.path.splitext(output_path)[1] or ".png"
    ok, encoded = cv2.imencode(ext, edges)
    if not ok:
        raise ValueError(f"{output_path}: OpenCV cannot write {ext} files")
    with atomic_path(output_path) as tmp:
        encoded.tofile(tmp)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import cv2  # noqa: F401
    except ImportError:
        print("error: tools/canny.py needs OpenCV: pip install opencv-python-headless", file=sys.stderr)
        return 2
    for name, value in (("--thres1", args.thres1), ("--thres2", args.thres2)):
        if not 0 <= value <= 255:
            print(f"error: {name} {value}: expected 0 to 255", file=sys.stderr)
            return 2
    if os.path.isdir(args.input):
        jobs = [(os.path.join(args.input, n), os.path.join(args.output, n)) for n in sorted(os.listdir(args.input))
                if os.path.splitext(n)[1].lower() in IMAGE_EXTENSIONS]
        if not jobs:
            print(f"error: --input {args.input}: no images in the folder", file=sys.stderr)
            return 2
        os.makedirs(args.output, exist_ok=True)
    elif os.path.isfile(args.input):
        jobs = [(args.input, args.output)]
    else:
        print(f"error: --input {args.input}: not found", file=sys.stderr)
        return 2
    for src, dst in jobs:
        try:
            canny(src, dst, args.thres1, args.thres2)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    print(f"wrote {len(jobs)} edge image(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
