"""Requests a running job takes at the next step: files in `<output_dir>/.control/` (the web UI writes them, the
loop looks once per step; the main process reads and removes them and every process acts on them together).

    sample   generate the sample prompts now (as --sample_every_n_steps would at this step)
    save     save the model now under its step name (and a state with --save_state)
"""

from __future__ import annotations

import logging
import os

from library.train import checkpoints as ckpt
from library.train.distributed import any_process

logger = logging.getLogger(__name__)

CONTROL_DIR = ".control"
REQUESTS = ("sample", "save")


def control_dir(output_dir: str) -> str:
    return os.path.join(output_dir, CONTROL_DIR)


def take_requests(output_dir: str) -> set[str]:
    """The requests waiting in the run's control folder, removed as they are taken (one look at one folder)."""
    folder = control_dir(output_dir)
    try:
        names = os.listdir(folder)
    except OSError:  # no folder: nothing asked (the usual case)
        return set()
    taken = set()
    for name in names:
        if name in REQUESTS:
            try:
                os.remove(os.path.join(folder, name))
            except FileNotFoundError:
                continue
            taken.add(name)
    return taken


def serve_requests(loop, step: int) -> set[str]:
    """Act on the requests at `step` (called by the loop after each optimizer step); returns what was done."""
    asked = take_requests(loop.t.output_dir) if loop.accelerator.is_main_process else set()
    done = {r for r in REQUESTS if any_process(r in asked, loop.device)}  # every process acts together
    if "sample" in done:
        hooks = [h for h in loop.s.hooks if callable(getattr(h, "due", None))]  # the sampling hook
        if hooks:
            logger.info("sample now (asked through %s): step %d", CONTROL_DIR, step)
            for hook in hooks:
                hook(loop, "sample_now", step)
        else:
            logger.warning("sample now: this run has no sample prompts (--sample_prompts); nothing generated")
    if "save" in done:
        logger.info("save now (asked through %s): step %d", CONTROL_DIR, step)
        progress = loop.run_state.progress
        stem = ckpt.step_stem(loop.t.output_name, step)
        loop.saver.save_model(stem, step, progress.epoch)
        if loop.t.save_state:
            loop.saver.save_state(ckpt.state_path(loop.t.output_dir, stem), progress)
    return done
