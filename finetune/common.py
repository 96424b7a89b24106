"""What the finetune/ scripts share: the common flags, logging, the one-line error convention, progress bars."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Callable, Iterable, Optional, Sequence

from tqdm import tqdm

from library.core.errors import run_tool

logger = logging.getLogger("finetune")


def setup_logging() -> None:
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "INFO"), format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def add_caption_extension(parser: argparse.ArgumentParser, default: str, what: str) -> None:
    """--caption_extension, and sd-scripts' old misspelling --caption_extention (it wins when given)."""
    parser.add_argument("--caption_extension", type=str, default=default, help=f"extension of the {what} files (default {default})")
    parser.add_argument("--caption_extention", type=str, default=None, help=argparse.SUPPRESS)


def caption_extension(args: argparse.Namespace) -> str:
    ext = args.caption_extention if args.caption_extention is not None else args.caption_extension
    return ext if ext.startswith(".") else "." + ext


def progress(items: Iterable, desc: str, total: Optional[int] = None, unit: str = "image") -> Iterable:
    """A tqdm bar with rate and ETA (smoothing 0: the ETA uses the mean rate, steady on large folders)."""
    return tqdm(items, desc=desc, total=total, unit=unit, smoothing=0.0, dynamic_ncols=True)


def warn_list(message: str, items: Sequence[Any], limit: int = 5) -> None:
    """One warning naming the count and the first few items."""
    if items:
        shown = ", ".join(str(i) for i in items[:limit]) + (" ..." if len(items) > limit else "")
        logger.warning("%d %s: %s", len(items), message, shown)


def script_main(build_parser: Callable[[], argparse.ArgumentParser], run: Callable[[argparse.Namespace], None],
                argv: Optional[Sequence[str]] = None) -> int:
    """Parse flags (argparse errors exit 2), then run with the one-line error convention (run_tool)."""
    setup_logging()
    args = build_parser().parse_args(argv)
    return run_tool(run, args)


class DecodedImages:
    """The images of `paths` as RGB PIL images, or `transform(image)`; a file that fails comes back as
    (path, None, reason) instead of stopping the tool."""

    def __init__(self, paths: list[str], transform: Optional[Callable[[Any], Any]] = None):
        self.paths, self.transform = paths, transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        from PIL import Image

        path = self.paths[i]
        try:
            with Image.open(path) as img:
                rgb = img.convert("RGB")
            return path, (self.transform(rgb) if self.transform else rgb), None
        except Exception as e:  # a damaged image is skipped, not fatal
            return path, None, f"{path}: cannot read image: {e}"


def _keep_as_is(item):
    return item


def image_loader(paths: list[str], workers: Optional[int], transform: Optional[Callable[[Any], Any]] = None):
    """A DataLoader over DecodedImages, one (path, image, error) at a time, decoded in `workers` processes."""
    import torch

    return torch.utils.data.DataLoader(DecodedImages(paths, transform), batch_size=None, shuffle=False,
                                       num_workers=workers or 0, collate_fn=_keep_as_is)


def in_batches(images: list[str], workers: Optional[int], batch_size: int, what: str,
               handle: Callable[[list[tuple[str, Any]]], None],
               transform: Optional[Callable[[Any], Any]] = None) -> int:
    """Decode `images` in `workers` background processes (through `transform`) and hand them to `handle` as
    (path, image) pairs, `batch_size` at a time, with a progress bar named `what`; unreadable images are skipped
    and listed once at the end. Returns how many images were handled."""
    failed, pending = [], []
    for path, image, problem in progress(image_loader(images, workers, transform), what, total=len(images)):
        if image is None:
            failed.append(problem)
            continue
        pending.append((path, image))
        if len(pending) >= batch_size:
            handle(pending)
            pending = []
    if pending:
        handle(pending)
    warn_list("images could not be read and were skipped", failed)
    return len(images) - len(failed)


def caption_images(images: list[str], workers: Optional[int], batch_size: int, extension: str,
                   describe: Callable[[list[Any]], list[str]], debug: bool = False) -> None:
    """Decode `images` in the background, caption them `batch_size` at a time with `describe` (PIL images ->
    captions) and write `<stem><extension>` beside each (atomically); unreadable images are listed once at the end."""
    from library.core.io_utils import atomic_write_text

    def write(batch: list[tuple[str, Any]]) -> None:
        for (path, _), caption in zip(batch, describe([img for _, img in batch])):
            atomic_write_text(os.path.splitext(path)[0] + extension, caption + "\n")
            if debug:
                logger.info("%s: %s", path, caption)

    logger.info("done: %d images captioned", in_batches(images, workers, batch_size, "captioning", write))
