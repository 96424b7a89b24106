"""Caption images with GIT (transformers' AutoModelForCausalLM + AutoProcessor) and write `<image><caption_extension>`.

    python finetune/make_captions_by_git.py train_data_dir --model_id GIT_FOLDER [--batch_size 8 --remove_words]

--model_id is a local folder as written by `save_pretrained` (e.g. microsoft/git-large-textcaps: config.json,
weights, preprocessor and tokenizer files), or a hub id already in the local Hugging Face cache; nothing is
downloaded. Images that already have a caption file are skipped (a stopped run goes on where it was);
--overwrite captions them again.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from finetune.common import add_caption_extension, caption_extension, caption_images, script_main  # noqa: E402

DEFAULT_MODEL_ID = "microsoft/git-large-textcaps"  # sd-scripts' default

# GIT trained on TextCaps likes to read text that is not there ("a man with the words 'xyz' on his shirt").
# --remove_words drops such phrases: words, letters, names or numbers said to be written on something.
_QUOTED = r"(?:\"[^\"]*\"?|'[^']*'?|\w+)"
READ_TEXT_PHRASES = [
    re.compile(rf"\s*\b(?:has|with|and) the (?:words?|letters?|name|number) {_QUOTED}"
               r"(?: (?:is |are )?(?:on|in) (?:the |her |his |their |its )?\w+)?"),
    re.compile(rf"\s*\b(?:with a sign )?that says {_QUOTED}(?: on it)?"),
    re.compile(r"\s*\bwith the number \d+ on (?:it|\w+(?: \w+)?)"),
    re.compile(rf"\s*\b(?:the )?word {_QUOTED} on it"),
]


def remove_words(caption: str) -> str:
    """The caption without phrases that read text into the image (--remove_words)."""
    for pattern in READ_TEXT_PHRASES:
        caption = pattern.sub("", caption)
    return re.sub(r"\s{2,}", " ", caption).strip()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("train_data_dir", help="folder of the images to caption")
    p.add_argument("--model_id", default=DEFAULT_MODEL_ID,
                   help=f"local GIT folder (save_pretrained layout) or a cached hub id (default {DEFAULT_MODEL_ID})")
    add_caption_extension(p, ".caption", "caption")
    p.add_argument("--batch_size", type=int, default=1, help="images per model call")
    p.add_argument("--max_data_loader_n_workers", type=int, default=None,
                   help="image decoding workers (default: main process)")
    p.add_argument("--max_length", type=int, default=50, help="longest caption, in tokens (default 50)")
    p.add_argument("--remove_words", action="store_true",
                   help="drop phrases like `with the words xxx` that read text into the image")
    p.add_argument("--recursive", action="store_true", help="also caption the images of every subfolder")
    p.add_argument("--overwrite", action="store_true",
                   help="caption images that already have a caption file too (default: skip them, so a run resumes)")
    p.add_argument("--debug", action="store_true", help="print every caption")
    return p


def load_git(model_id: str):
    """(model, processor) from a local folder or the local hub cache; a one-line UserError when missing."""
    from library.core.errors import UserError

    expected = ("expected a local transformers GIT folder (config.json, weights, preprocessor and tokenizer "
                "files, as save_pretrained writes them) or a hub id already in the Hugging Face cache; "
                "weights are not downloaded here")
    if os.path.isfile(model_id):
        raise UserError(f"--model_id: {model_id} is a file: {expected}")
    if os.path.isdir(model_id) and not os.path.isfile(os.path.join(model_id, "config.json")):
        raise UserError(f"--model_id: {os.path.join(model_id, 'config.json')} not found: {expected}")
    from transformers import AutoModelForCausalLM, AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(model_id, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(model_id, local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserError(f"--model_id: cannot load {model_id}: {str(e).splitlines()[0]}; {expected}") from None
    return model.eval(), processor


def run(args: argparse.Namespace) -> None:
    import torch

    from finetune.common import logger
    from library.core.errors import UserError
    from library.data.finetune_metadata import list_dataset_images

    for name in ("batch_size", "max_length"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name}: expected 1 or more, got {getattr(args, name)}")
    if args.max_data_loader_n_workers is not None and args.max_data_loader_n_workers < 0:
        raise UserError(f"--max_data_loader_n_workers: expected 0 or more, got {args.max_data_loader_n_workers}")
    images = list_dataset_images(args.train_data_dir, args.recursive)
    ext = caption_extension(args)
    model, processor = load_git(args.model_id)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    if not args.overwrite:
        before = len(images)
        images = [p for p in images if not os.path.isfile(os.path.splitext(p)[0] + ext)]
        if before > len(images):
            logger.info("%d images already have a %s file and are skipped (--overwrite captions them again)",
                        before - len(images), ext)
    logger.info("captioning %d images with %s", len(images), args.model_id)

    def describe(batch: list) -> list[str]:
        inputs = processor(images=batch, return_tensors="pt").to(device)
        with torch.no_grad():
            ids = model.generate(pixel_values=inputs["pixel_values"], max_length=args.max_length)
        captions = processor.batch_decode(ids, skip_special_tokens=True)
        return [remove_words(c) if args.remove_words else c.strip() for c in captions]

    caption_images(images, args.max_data_loader_n_workers, args.batch_size, ext, describe, args.debug)


def main(argv=None) -> int:
    return script_main(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
