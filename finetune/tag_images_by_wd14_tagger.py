"""Tag images with a WD14 tagger (ONNX model + selected_tags.csv) and write `<image><caption_extension>` (default .txt).

    python finetune/tag_images_by_wd14_tagger.py train_data_dir --onnx --model_dir wd14_tagger_model \\
        [--repo_id SmilingWolf/wd-v1-4-convnext-tagger-v2] [--general_threshold 0.35] [--character_threshold 0.35]

The model is read from `<model_dir>/<repo_id with "/" -> "_">/` (sd-scripts' layout) or from `<model_dir>`
itself: `model.onnx` and `selected_tags.csv`. Nothing is downloaded: a missing file is an error naming it.
The Keras (TensorFlow SavedModel) form sd-scripts uses without --onnx is not supported: use the model.onnx
of the same repository. Selection rules: library/data/wd14_tags.py and docs/finetune_tools.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from finetune.common import add_caption_extension, caption_extension, in_batches, script_main  # noqa: E402

DEFAULT_REPO = "SmilingWolf/wd-v1-4-convnext-tagger-v2"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("train_data_dir", help="folder of the images to tag")
    p.add_argument("--repo_id", default=DEFAULT_REPO, help="tagger repository; its files are looked for in <model_dir>/<repo_id, / -> _>")
    p.add_argument("--model_dir", default="wd14_tagger_model", help="folder holding the tagger models")
    p.add_argument("--force_download", action="store_true", help="not available here (no downloads): an error")
    p.add_argument("--batch_size", type=int, default=1, help="images per model call")
    p.add_argument("--max_data_loader_n_workers", type=int, default=None, help="image decoding workers (default: main process)")
    add_caption_extension(p, ".txt", "tag")
    p.add_argument("--thresh", type=float, default=0.35, help="threshold for both kinds of tags unless set below")
    p.add_argument("--general_threshold", type=float, default=None, help="threshold for general tags (default --thresh)")
    p.add_argument("--character_threshold", type=float, default=None, help="threshold for character tags (default --thresh)")
    p.add_argument("--recursive", action="store_true", help="also tag the images of every subfolder")
    p.add_argument("--remove_underscore", action="store_true", help="'_' -> ' ' in tags longer than 3 characters")
    p.add_argument("--undesired_tags", default="", help="tags never written, separated by the caption separator")
    p.add_argument("--frequency_tags", action="store_true", help="print how often each tag was written")
    p.add_argument("--onnx", action="store_true", help="use model.onnx (the only form supported here; implied)")
    p.add_argument("--append_tags", action="store_true", help="keep the tags already in the file, add the new ones")
    p.add_argument("--use_rating_tags", action="store_true", help="put the rating tag first")
    p.add_argument("--use_rating_tags_as_last_tag", action="store_true", help="put the rating tag last")
    p.add_argument("--character_tags_first", action="store_true", help="character tags before general tags")
    p.add_argument("--always_first_tags", default=None, help="tags moved to the front when present, separated by the caption separator")
    p.add_argument("--caption_separator", default=", ", help="separator between tags in the written file")
    p.add_argument("--tag_replacement", default=None, help="source,target;source2,target2 (\\, and \\; escape)")
    p.add_argument("--character_tag_expand", action="store_true", help="name_(series) -> name, series")
    p.add_argument("--skip_existing", action="store_true", help="leave images that already have a tag file (resume a large folder)")
    p.add_argument("--debug", action="store_true", help="print the tags of every image")
    return p


def model_location(model_dir: str, repo_id: str) -> str:
    """sd-scripts' `<model_dir>/<repo_id with / -> _>`, or model_dir itself when it holds the files."""
    nested = os.path.join(model_dir, repo_id.replace("/", "_"))
    if os.path.isdir(nested) or not os.path.isfile(os.path.join(model_dir, "selected_tags.csv")):
        return nested
    return model_dir


def preprocessed(image, size: int):
    """WD14 input of a decoded RGB image (square, BGR, float32)."""
    import numpy as np

    from library.data.wd14_tags import preprocess

    return preprocess(np.asarray(image), size)


def load_session(location: str):
    """(onnxruntime session, input name, input size, fixed batch size or None)."""
    from library.core.errors import UserError

    onnx_path = os.path.join(location, "model.onnx")
    if not os.path.isfile(onnx_path):
        keras = os.path.isfile(os.path.join(location, "saved_model.pb"))
        raise UserError(f"--model_dir: {onnx_path} not found: expected a WD14 tagger model.onnx and selected_tags.csv in "
                        f"{location} (weights are not downloaded here)"
                        + ("; the Keras SavedModel there is not supported, use the repository's model.onnx" if keras else ""))
    try:
        import onnxruntime as ort
    except ImportError:
        raise UserError("onnxruntime is not installed: pip install onnxruntime (or onnxruntime-gpu)") from None
    providers = [p for p in ("CUDAExecutionProvider", "ROCMExecutionProvider") if p in ort.get_available_providers()]
    session = ort.InferenceSession(onnx_path, providers=providers + ["CPUExecutionProvider"])
    first = session.get_inputs()[0]
    shape = first.shape  # (N, H, W, 3); N may be a name (dynamic)
    size = shape[1] if isinstance(shape[1], int) else 448
    batch = shape[0] if isinstance(shape[0], int) and shape[0] > 0 else None
    return session, first.name, size, batch


def run(args: argparse.Namespace) -> None:
    import numpy as np

    from finetune.common import logger
    from library.core.errors import UserError
    from library.core.io_utils import atomic_write_text
    from library.data.finetune_metadata import list_dataset_images
    from library.data.wd14_tags import (
        TagFrequency,
        TagOptions,
        merge_with_existing,
        prepare_labels,
        read_selected_tags,
        select_tags,
    )

    if args.batch_size < 1:
        raise UserError(f"--batch_size: expected 1 or more, got {args.batch_size}")
    location = model_location(args.model_dir, args.repo_id)
    if args.force_download:
        raise UserError("--force_download: downloading is not available; put model.onnx and selected_tags.csv in " + location)
    csv_path = os.path.join(location, "selected_tags.csv")
    if not os.path.isfile(csv_path):
        raise UserError(f"--model_dir: {csv_path} not found: expected a WD14 tagger model.onnx and selected_tags.csv in "
                        f"{location} (weights are not downloaded here)")
    images = list_dataset_images(args.train_data_dir, args.recursive)
    ext = caption_extension(args)
    sep = args.caption_separator
    opts = TagOptions(
        general_threshold=args.thresh if args.general_threshold is None else args.general_threshold,
        character_threshold=args.thresh if args.character_threshold is None else args.character_threshold,
        remove_underscore=args.remove_underscore,
        undesired_tags=frozenset(t.strip() for t in args.undesired_tags.split(sep.strip()) if t.strip()),
        character_tags_first=args.character_tags_first, use_rating_tags=args.use_rating_tags,
        use_rating_tags_as_last_tag=args.use_rating_tags_as_last_tag,
        always_first_tags=[t.strip() for t in args.always_first_tags.split(sep.strip()) if t.strip()]
        if args.always_first_tags else None,
        character_tag_expand=args.character_tag_expand, caption_separator=sep, tag_replacement=args.tag_replacement)
    labels = prepare_labels(read_selected_tags(csv_path), opts)
    session, input_name, size, fixed_batch = load_session(location)
    batch_size = args.batch_size
    if fixed_batch is not None and fixed_batch != batch_size:
        logger.warning("the model takes batches of %d: --batch_size %d ignored", fixed_batch, batch_size)
        batch_size = fixed_batch
    if args.skip_existing:
        before = len(images)
        images = [p for p in images if not os.path.isfile(os.path.splitext(p)[0] + ext)]
        logger.info("%d images already have a %s file and are skipped", before - len(images), ext)
    logger.info("tagging %d images with %s", len(images), location)

    freq = TagFrequency()

    def tag(pending: list[tuple[str, np.ndarray]]) -> None:
        batch = np.stack([img for _, img in pending])
        if fixed_batch is not None and len(pending) < fixed_batch:  # pad a short last batch
            batch = np.concatenate([batch, np.zeros((fixed_batch - len(pending), *batch.shape[1:]), np.float32)])
        probs = session.run(None, {input_name: batch})[0][: len(pending)]
        for (path, _), row in zip(pending, probs):
            tags = select_tags(row, labels, opts)
            out = os.path.splitext(path)[0] + ext
            if args.append_tags and os.path.isfile(out):
                with open(out, encoding="utf-8") as f:
                    tags = merge_with_existing(f.read(), tags, sep)
            freq.add(tags)
            atomic_write_text(out, sep.join(tags) + "\n")
            if args.debug:
                logger.info("%s: %s", path, sep.join(tags))

    tagged = in_batches(images, args.max_data_loader_n_workers, batch_size, "tagging", tag,
                        functools.partial(preprocessed, size=size))
    if args.frequency_tags:
        print("Tag frequencies:")
        for tag, n in freq.most_common():
            print(f"{tag}: {n}")
    logger.info("done: %d images tagged", tagged)


def main(argv=None) -> int:
    return script_main(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
