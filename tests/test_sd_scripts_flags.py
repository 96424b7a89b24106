"""sd-scripts flags that act here as there (none is an 'unrecognized argument'): deprecated FLUX.1 block-swap aliases,
--text_encoder_batch_size, --console_log_*."""

import contextlib
import logging
import os

import pytest
import torch

from library.cli.memory import blocks_to_swap_with_aliases
from library.cli.text_cache import text_cache_options_from_args
from library.core.errors import ConfigError


def test_deprecated_block_swap_flags_map_as_sd_scripts(caplog):
    caplog.set_level(logging.WARNING)
    assert blocks_to_swap_with_aliases({"split_mode": True}) == 18  # flux_train_network.py
    assert blocks_to_swap_with_aliases({"split_mode": True, "blocks_to_swap": 6}) == 6
    assert blocks_to_swap_with_aliases({"double_blocks_to_swap": 4, "single_blocks_to_swap": 7}) == 7  # 4 + 7 // 2
    assert blocks_to_swap_with_aliases({"blocks_to_swap": 5}) == 5
    assert sum("deprecated" in r.message for r in caplog.records) == 3
    with pytest.raises(ConfigError, match="^--double_blocks_to_swap / --single_blocks_to_swap: deprecated forms"):
        blocks_to_swap_with_aliases({"double_blocks_to_swap": 4, "blocks_to_swap": 5})


def test_text_encoder_batch_size_sets_the_caching_batch():
    assert text_cache_options_from_args({"cache_text_encoder_outputs": True, "vae_batch_size": 3}).batch_size == 3
    assert text_cache_options_from_args({"cache_text_encoder_outputs": True, "vae_batch_size": 3,
                                         "text_encoder_batch_size": 8}).batch_size == 8


def test_console_log_file_level_and_simple(tmp_path):
    from library.cli.entry import configure_console_logging

    root = logging.getLogger()
    before = (root.level, list(root.handlers), [h.formatter for h in root.handlers])
    path = tmp_path / "run.log"
    try:
        configure_console_logging("WARNING", str(path), True)
        logging.getLogger("x").info("hidden")
        logging.getLogger("x").warning("shown")
    finally:
        for h in root.handlers:
            if h not in before[1]:
                h.close()
        root.handlers[:] = before[1]
        for h, f in zip(before[1], before[2]):
            h.setFormatter(f)
        root.setLevel(before[0])
    assert path.read_text() == "shown\n"
    with pytest.raises(ConfigError, match="^--console_log_file .*: its folder does not exist$"):
        configure_console_logging(None, str(tmp_path / "no" / "run.log"), False)


def test_initial_step_positions_as_sd_scripts():
    """--initial_step with --skip_until_initial_step: step N+1, mid-epoch on the batches an uninterrupted run sees
    there; without it only the epoch moves; --initial_epoch E is (E-1) epochs of steps."""
    from library.train.state import TrainProgress
    from library.train.step_position import initial_progress

    assert initial_progress(None, None, False, 5, 1, 20) is None
    assert initial_progress(7, None, True, 5, 2, 20) == TrainProgress(epoch=2, global_step=7, batches_done=4)
    assert initial_progress(7, None, False, 5, 2, 20) == TrainProgress(epoch=2, global_step=0, batches_done=0)
    assert initial_progress(None, 3, True, 5, 1, 20) == TrainProgress(epoch=3, global_step=10, batches_done=0)
    assert initial_progress(4, 3, True, 5, 1, 20) == TrainProgress(epoch=1, global_step=4, batches_done=4)
    resumed = TrainProgress(epoch=4, global_step=17, batches_done=2)
    assert initial_progress(4, None, True, 5, 1, 20, resumed) == TrainProgress(epoch=1, global_step=4, batches_done=4)
    with pytest.raises(ConfigError, match=r"^--initial_step 20: expected fewer than --max_train_steps \(20\)$"):
        initial_progress(20, None, True, 5, 1, 20)


def test_skip_until_initial_step_trains_only_the_remaining_steps(tmp_path):
    """A tiny SD1 run of --max_train_steps 4 from --initial_step 3 --skip_until_initial_step makes one optimizer
    step (the scheduler counts 1) and ends at step 4."""
    from tests.train_helpers import base_args, make_dataset, make_trainer

    data = make_dataset(str(tmp_path / "data"))
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), steps=4,
                                     extra=["--initial_step", "3", "--skip_until_initial_step"]))
    trainer.run()
    assert trainer.run_state.progress.global_step == 4
    assert trainer.lr_scheduler.last_epoch == 1


@pytest.mark.parametrize("family,preset", [("sd", "tiny:sd1"), ("sdxl", "tiny:sdxl")])
def test_weighted_captions_weight_the_training_conditioning(family, preset):
    """--weighted_captions: an unweighted caption encodes exactly as without the flag; '(word:1.5)' changes the
    conditioning (and equals the sampling path's weighting of the same prompt)."""
    from library.families import get_family
    from library.families.base import LoadOptions
    from library.train.step import StepContext, encode_captions

    fam = get_family(family)
    components = fam.load(LoadOptions(preset))

    def ctx(weighted):
        return StepContext(family=fam, components=components, scheme=None, noise=None, loss=None,
                           device=torch.device("cpu"), weight_dtype=torch.float32, clip_skip=None,
                           max_token_length=None, train_text_encoder=False, autocast=contextlib.nullcontext,
                           weighted_captions=weighted)

    with torch.no_grad():
        plain = encode_captions(ctx(False), ["sks toy, red"]).tensors
        same = encode_captions(ctx(True), ["sks toy, red"]).tensors
        weighted = encode_captions(ctx(True), ["(sks toy:1.5), red"]).tensors
        literal = encode_captions(ctx(False), ["(sks toy:1.5), red"]).tensors
    assert plain.keys() == same.keys() == weighted.keys()
    assert all(torch.equal(plain[k], same[k]) for k in plain)
    key = "encoder_hidden_states" if family == "sd" else "hidden_state1"
    assert weighted[key].shape == plain[key].shape
    assert not torch.equal(weighted[key], plain[key]) and not torch.equal(weighted[key], literal[key])


def test_weighted_captions_refusals(tmp_path):
    from tests.train_helpers import base_args, make_trainer

    with pytest.raises(ConfigError, match="^--weighted_captions: not supported for flux "):
        make_trainer(base_args(str(tmp_path), str(tmp_path / "o"), preset="tiny:flux",
                               extra=["--weighted_captions"]), "flux")
    with pytest.raises(ConfigError, match="^--weighted_captions with --cache_text_encoder_outputs: "):
        make_trainer(base_args(str(tmp_path), str(tmp_path / "o"), preset="tiny:sdxl",
                               extra=["--weighted_captions", "--cache_text_encoder_outputs"]), "sdxl")


def test_weighted_captions_train_with_text_encoder_lora(tmp_path):
    """A tiny SD1 LoRA run with --weighted_captions, the text encoder LoRA included: the weighted path carries
    gradients to the text encoder's LoRA (its weights change)."""
    from safetensors.torch import load_file

    from tests.train_helpers import base_args, make_dataset, make_trainer

    data = make_dataset(str(tmp_path / "data"), n=2)
    path = make_trainer(base_args(data, str(tmp_path / "out"), steps=2, extra=["--weighted_captions"])).run()
    te_up = [v for k, v in load_file(path).items() if k.startswith("lora_te_") and k.endswith("lora_up.weight")]
    assert te_up and any(bool(v.abs().sum() > 0) for v in te_up)


def test_debug_dataset_prints_batches_without_training(tmp_path, capsys):
    """--debug_dataset: the first epoch's batches (4 images x 5 repeats, batch 1: 20), each with its caption; no
    model file, exit code 0; --debug_dataset_dir writes each batch's image."""
    from library.cli.entry import run_training
    from tests.train_helpers import base_args, make_dataset

    data = make_dataset(str(tmp_path / "data"))
    out = tmp_path / "out"
    code = run_training("sd", "t", base_args(data, str(out), extra=["--debug_dataset", "--debug_dataset_dir",
                                                                     str(tmp_path / "seen")]))
    printed = capsys.readouterr().out
    assert code == 0
    assert printed.count("\n    caption: sks toy, square, color ") == 20
    assert printed.count("epoch 1 batch ") == 20 and "epoch 1 batch 20/20 step 20: bucket " in printed
    assert not out.exists() or not [n for n in os.listdir(out) if n.endswith(".safetensors")]
    assert len(os.listdir(tmp_path / "seen")) == 20
