"""Write the small example dataset under examples/data/ (simple coloured shapes with .txt captions).

    python tools/make_example_data.py [--out examples/data]

The images are generated, not downloaded, so the dataset is reproducible and free to ship.
"""

from __future__ import annotations

import argparse
import os

from PIL import Image, ImageDraw

# (file stem, (width, height), shape, colour name, RGB, background name, background RGB)
EXAMPLES = [
    ("red_circle", (128, 128), "circle", "red", (220, 30, 30), "white", (255, 255, 255)),
    ("blue_square", (128, 128), "square", "blue", (30, 60, 220), "white", (255, 255, 255)),
    ("green_triangle", (128, 128), "triangle", "green", (30, 170, 60), "yellow", (250, 240, 170)),
    ("yellow_circle", (192, 128), "circle", "yellow", (240, 200, 20), "black", (0, 0, 0)),
    ("purple_square", (192, 128), "square", "purple", (130, 40, 170), "white", (255, 255, 255)),
    ("orange_triangle", (128, 192), "triangle", "orange", (245, 140, 20), "blue", (200, 220, 250)),
    ("red_square", (128, 192), "square", "red", (220, 30, 30), "grey", (128, 128, 128)),
]

TRAIN_FOLDER = os.path.join("train", "10_sks shape")  # 10 repeats, class tokens "sks shape"


def draw_example(size: tuple[int, int], shape: str, colour: tuple, background: tuple) -> Image.Image:
    """One image: a centred shape filling about half of the shorter side."""
    image = Image.new("RGB", size, background)
    draw = ImageDraw.Draw(image)
    w, h = size
    r = min(w, h) // 4
    cx, cy = w // 2, h // 2
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=colour)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    return image


def write_examples(out_dir: str) -> list[str]:
    """Write every example image and caption; return the image paths."""
    folder = os.path.join(out_dir, TRAIN_FOLDER)
    os.makedirs(folder, exist_ok=True)
    paths = []
    for stem, size, shape, colour_name, colour, bg_name, bg in EXAMPLES:
        path = os.path.join(folder, stem + ".png")
        draw_example(size, shape, colour, bg).save(path, optimize=True)
        with open(os.path.join(folder, stem + ".txt"), "w", encoding="utf-8") as f:
            f.write(f"sks shape, {colour_name} {shape}, {bg_name} background\n")
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join("examples", "data"), help="output folder")
    args = parser.parse_args()
    paths = write_examples(args.out)
    print(f"wrote {len(paths)} images to {os.path.join(args.out, TRAIN_FOLDER)}")


if __name__ == "__main__":
    main()
