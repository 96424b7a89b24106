"""Caption images with BLIP (transformers' BlipForConditionalGeneration) and write `<image><caption_extension>` (default .caption).

    python finetune/make_captions.py train_data_dir --caption_weights BLIP_FOLDER [--beam_search --num_beams 3]

--caption_weights (alias --model_path) is a local folder as written by `save_pretrained` (e.g.
Salesforce/blip-image-captioning-large: config.json, weights, preprocessor and tokenizer files). Nothing is
downloaded; sd-scripts' own BLIP checkpoint (model_large_caption.pth) is not supported.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from finetune.common import add_caption_extension, caption_extension, caption_images, script_main  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("train_data_dir", help="folder of the images to caption")
    p.add_argument("--caption_weights", "--model_path", dest="caption_weights", default=None,
                   help="local transformers BLIP captioning folder (save_pretrained layout)")
    add_caption_extension(p, ".caption", "caption")
    p.add_argument("--beam_search", action="store_true", help="beam search (default: nucleus sampling)")
    p.add_argument("--batch_size", type=int, default=1, help="images per model call")
    p.add_argument("--max_data_loader_n_workers", type=int, default=None, help="image decoding workers (default: main process)")
    p.add_argument("--num_beams", type=int, default=1, help="beams with --beam_search")
    p.add_argument("--top_p", type=float, default=0.9, help="top_p of nucleus sampling")
    p.add_argument("--max_length", type=int, default=75, help="longest caption, in tokens")
    p.add_argument("--min_length", type=int, default=5, help="shortest caption, in tokens")
    p.add_argument("--seed", type=int, default=42, help="seed of the sampling")
    p.add_argument("--recursive", action="store_true", help="also caption the images of every subfolder")
    p.add_argument("--skip_existing", action="store_true", help="leave images that already have a caption file (resume a large folder)")
    p.add_argument("--debug", action="store_true", help="print every caption")
    return p


def load_blip(folder):
    """(model, processor) from a local folder; a one-line UserError naming the path and what is expected."""
    from library.core.errors import UserError

    expected = ("expected a transformers BLIP captioning folder (config.json, model.safetensors, processor"
                " and tokenizer files, as save_pretrained writes them; weights are not downloaded here)")
    if not folder:
        raise UserError(f"--caption_weights: not given: {expected}")
    if os.path.isfile(folder):
        raise UserError(f"--caption_weights: {folder} is a file: {expected}; sd-scripts' BLIP .pth checkpoints are not supported")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise UserError(f"--caption_weights: {os.path.join(folder, 'config.json')} not found: {expected}")
    from transformers import BlipForConditionalGeneration, BlipProcessor

    try:
        processor = BlipProcessor.from_pretrained(folder, local_files_only=True)
        model = BlipForConditionalGeneration.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserError(f"--caption_weights: cannot load {folder}: {str(e).splitlines()[0]}; {expected}") from None
    return model.eval(), processor


def run(args: argparse.Namespace) -> None:
    import torch

    from finetune.common import logger
    from library.core.errors import UserError
    from library.data.finetune_metadata import list_dataset_images

    for name in ("batch_size", "num_beams", "max_length"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name}: expected 1 or more, got {getattr(args, name)}")
    if args.min_length > args.max_length:
        raise UserError(f"--min_length {args.min_length} is larger than --max_length {args.max_length}")
    images = list_dataset_images(args.train_data_dir, args.recursive)
    ext = caption_extension(args)
    model, processor = load_blip(args.caption_weights)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    if args.skip_existing:
        before = len(images)
        images = [p for p in images if not os.path.isfile(os.path.splitext(p)[0] + ext)]
        logger.info("%d images already have a %s file and are skipped", before - len(images), ext)
    logger.info("captioning %d images", len(images))
    torch.manual_seed(args.seed)
    if args.beam_search:
        generate = dict(num_beams=args.num_beams, do_sample=False)
    else:
        generate = dict(num_beams=1, do_sample=True, top_p=args.top_p)
    generate.update(max_length=args.max_length, min_length=args.min_length)

    def describe(batch: list) -> list[str]:
        inputs = processor(images=batch, return_tensors="pt").to(device)
        with torch.no_grad():
            ids = model.generate(pixel_values=inputs["pixel_values"], **generate)
        return [c.strip() for c in processor.batch_decode(ids, skip_special_tokens=True)]

    caption_images(images, args.max_data_loader_n_workers, args.batch_size, ext, describe, args.debug)


def main(argv=None) -> int:
    return script_main(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
