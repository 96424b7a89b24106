"""Numeric flags are range-checked before anything loads, and --clip_skip against the loaded
text encoder before step 1; each bad value is one line on stderr and exit code 2."""

import glob
import os

import pytest

from library.cli.entry import run_training
from library.core.errors import ConfigError
from library.families import get_family
from library.train.settings import TextEncodingOptions
from tests.train_helpers import base_args, make_dataset

BAD_VALUES = [
    ("sd", "--learning_rate", "3e38"), ("sd", "--learning_rate", "nan"), ("sd", "--learning_rate", "inf"),
    ("sd", "--learning_rate", "-1e-4"), ("sd", "--unet_lr", "100"), ("sd", "--text_encoder_lr", "-1"),
    ("sd", "--max_train_steps", "-5"), ("sd", "--max_train_epochs", "0"), ("sd", "--train_batch_size", "0"),
    ("sd", "--gradient_accumulation_steps", "0"), ("sd", "--caption_dropout_rate", "1.5"),
    ("sd", "--caption_tag_dropout_rate", "-0.1"), ("sd", "--network_dropout", "2"), ("sd", "--network_dim", "0"),
    ("sd", "--network_alpha", "-1"), ("sd", "--seed", "-1"), ("sd", "--seed", "99999999999"),
    ("sd", "--validation_split", "1.0"), ("sd", "--noise_offset", "-0.1"), ("sd", "--min_timestep", "2000"),
    ("sd", "--save_every_n_steps", "0"), ("sd", "--vae_batch_size", "0"), ("sd", "--max_grad_norm", "inf"),
    ("sd", "--lr_scheduler_num_cycles", "0"), ("sd", "--ema_decay", "1.5"), ("sd", "--resolution", "500"),
    ("sd", "--multires_noise_discount", "0"), ("sd", "--huber_c", "0"), ("sd", "--sample_batch_size", "0"),
    ("sd", "--max_data_loader_n_workers", "-1"), ("sd", "--keep_tokens", "-1"), ("sd", "--dataset_repeats", "0"),
    ("sd", "--prior_loss_weight", "-1"), ("sd", "--base_weights_multiplier", "nan"), ("sd", "--log_every_n_steps", "0"),
    ("sd", "--network_multiplier", "inf"), ("sd", "--bucket_reso_steps", "0"), ("sd", "--clip_skip", "0"),
    ("flux", "--guidance_scale", "nan"), ("flux", "--discrete_flow_shift", "0"), ("flux", "--sigmoid_scale", "-1"),
    ("flux", "--logit_std", "0"),
]


@pytest.mark.parametrize("family,flag,value", BAD_VALUES, ids=[f"{f}{v}" for _, f, v in BAD_VALUES])
def test_numeric_flag_out_of_range_is_one_line_exit_2(tmp_path, capsys, family, flag, value):
    """A numeric flag outside its range stops the run before anything loads: exit 2, one line
    naming the flag, the value and the expected range."""
    out = str(tmp_path / "out")
    argv = ["--pretrained_model_name_or_path", f"tiny:{'sd1' if family == 'sd' else family}", "--output_dir", out,
            "--train_data_dir", str(tmp_path / "missing"), f"{flag}={value}"]
    if flag == "--base_weights_multiplier":
        argv += ["--base_weights", "a.safetensors"]
    assert run_training(family, "t", argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {flag}") and "expected" in err and "\n" not in err, err
    assert not os.path.exists(out)


def test_defaults_and_usual_values_pass(tmp_path):
    """The range table accepts every default and the usual values."""
    from library.cli.config_file import parse_with_config_file
    from library.cli.entry import build_parser
    from library.cli.ranges import check_ranges

    for name, fine_tune in (("sd", False), ("sdxl", True), ("flux", False)):
        family = get_family(name)
        argv = ["--pretrained_model_name_or_path", "p", "--output_dir", str(tmp_path), "--learning_rate", "1.0",
                "--clip_skip", "2", "--seed", "0", "--resolution", "512,768"]
        check_ranges(vars(parse_with_config_file(build_parser("t", family, fine_tune), argv)))
        if not fine_tune:
            check_ranges(vars(parse_with_config_file(build_parser("t", family), base_args("d", str(tmp_path)))))


def test_clip_skip_beyond_the_encoder_stops_before_step_one(tmp_path, capsys, tiny_sd1):
    """--clip_skip is checked against the loaded text encoder (ModelFamily.check_loaded) before any step: 50 on a
    12-layer encoder is one line, not an IndexError at the first step."""
    family = get_family("sd")
    layers = tiny_sd1.text_encoders[0].config.num_hidden_layers
    family.check_loaded(tiny_sd1, TextEncodingOptions(clip_skip=layers))
    with pytest.raises(ConfigError, match=f"--clip_skip {layers + 1}: the text encoder of this model has {layers}"):
        family.check_loaded(tiny_sd1, TextEncodingOptions(clip_skip=layers + 1))

    data = make_dataset(str(tmp_path), n=1)
    out = str(tmp_path / "out")
    assert run_training("sd", "t", base_args(data, out, steps=1, extra=["--clip_skip", "50"])) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --clip_skip 50: the text encoder of this model has") and "\n" not in err, err
    assert not glob.glob(os.path.join(out, "*.safetensors"))


def test_every_numeric_flag_has_a_range():
    """Each int/float flag of every training parser (sd/sdxl/flux, LoRA and fine-tune) has an
    entry in library/cli/ranges.py RANGES (a new numeric flag without one fails here)."""
    from library.cli.entry import build_parser
    from library.cli.ranges import RANGES

    missing = set()
    for name in ("sd", "sdxl", "flux"):
        for fine_tune in (False, True):
            parser = build_parser("t", get_family(name), fine_tune)
            missing |= {a.dest for a in parser._actions
                        if a.type in (int, float) and a.dest not in RANGES and a.dest != "max_token_length"}
    assert not missing  # max_token_length: argparse choices (75, 150, 225)


def test_generate_refuses_clip_skip_beyond_the_encoder(tmp_path, capsys):
    """tools/generate.py checks --clip_skip against the loaded text encoder too (one line)."""
    from tools import generate

    rc = generate.main(["--ckpt", "tiny:sd1", "--outdir", str(tmp_path), "--prompt", "a cat", "--steps", "1",
                        "--W", "64", "--H", "64", "--clip_skip", "50"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: --clip_skip 50: the text encoder of this model has"), err
