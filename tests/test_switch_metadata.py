"""What a LoRA trained here says about itself, key by key against what sd-scripts writes for the same run,
and which --network_module names sd-scripts users type."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from safetensors import safe_open

from library.core import hashes
from library.core import metadata as M
from library.train.adapters.network_kinds import OwnLoRA, network_kind
from library.train.run_metadata import timestep_range
from tests.train_helpers import base_args, make_dataset, make_trainer

# The keys sd-scripts 48d368f writes into a LoRA of train_network.py, read from its source:
# train_network.py 1004-1064 (every run), update_metadata (family), 1157-1159 (with --dataset_config) or
# 1183-1198 (without), 1204 (--network_args), 1210-1213 (model name and hashes: an existing path),
# 1301-1303 (at each save), get_sai_model_spec (modelspec.*) and save_weights (sshs_*).
SD_SCRIPTS_COMMON = {
    "ss_session_id", "ss_training_started_at", "ss_output_name", "ss_learning_rate", "ss_text_encoder_lr",
    "ss_unet_lr", "ss_num_train_images", "ss_num_validation_images", "ss_num_reg_images",
    "ss_num_batches_per_epoch", "ss_num_epochs", "ss_gradient_checkpointing", "ss_gradient_accumulation_steps",
    "ss_max_train_steps", "ss_lr_warmup_steps", "ss_lr_scheduler", "ss_network_module", "ss_network_dim",
    "ss_network_alpha", "ss_network_dropout", "ss_mixed_precision", "ss_full_fp16", "ss_v2",
    "ss_base_model_version", "ss_clip_skip", "ss_max_token_length", "ss_cache_latents", "ss_seed", "ss_lowram",
    "ss_noise_offset", "ss_multires_noise_iterations", "ss_multires_noise_discount", "ss_adaptive_noise_scale",
    "ss_zero_terminal_snr", "ss_training_comment", "ss_sd_scripts_commit_hash", "ss_optimizer", "ss_max_grad_norm",
    "ss_caption_dropout_rate", "ss_caption_dropout_every_n_epochs", "ss_caption_tag_dropout_rate",
    "ss_face_crop_aug_range", "ss_prior_loss_weight", "ss_min_snr_gamma", "ss_scale_weight_norms",
    "ss_ip_noise_gamma", "ss_debiased_estimation", "ss_noise_offset_random_strength",
    "ss_ip_noise_gamma_random_strength", "ss_loss_type", "ss_huber_schedule", "ss_huber_scale", "ss_huber_c",
    "ss_fp8_base", "ss_fp8_base_unet", "ss_validation_seed", "ss_validation_split", "ss_max_validation_steps",
    "ss_validate_every_n_epochs", "ss_validate_every_n_steps", "ss_resize_interpolation",
    "ss_training_finished_at", "ss_steps", "ss_epoch", "ss_sd_model_name",
    "modelspec.sai_model_spec", "modelspec.architecture", "modelspec.implementation", "modelspec.title",
    "modelspec.resolution", "modelspec.date", "modelspec.implementation_version",
    "sshs_model_hash", "sshs_legacy_hash",
}
SD_SCRIPTS_FLAT = {
    "ss_batch_size_per_device", "ss_total_batch_size", "ss_resolution", "ss_color_aug", "ss_flip_aug",
    "ss_random_crop", "ss_shuffle_caption", "ss_enable_bucket", "ss_bucket_no_upscale", "ss_min_bucket_reso",
    "ss_max_bucket_reso", "ss_keep_tokens", "ss_dataset_dirs", "ss_reg_dataset_dirs", "ss_tag_frequency",
    "ss_bucket_info",
}
SD_SCRIPTS_CONFIG = {"ss_datasets", "ss_tag_frequency", "ss_dataset_dirs"}
SD_SCRIPTS_MODEL_FILE = {"ss_sd_model_hash", "ss_new_sd_model_hash"}
SD_SCRIPTS_FLUX = {  # flux_train_network.py update_metadata
    "ss_model_type", "ss_apply_t5_attn_mask", "ss_weighting_scheme", "ss_logit_mean", "ss_logit_std",
    "ss_mode_scale", "ss_guidance_scale", "ss_timestep_sampling", "ss_sigmoid_scale", "ss_model_prediction_type",
    "ss_discrete_flow_shift",
}
# Deliberate differences (docs/differences.md, "Files and metadata"):
NOT_WRITTEN = {"ss_sd_scripts_commit_hash"}  # not sd-scripts: modelspec.implementation_version names us
BUCKETING_OFF = {"ss_min_bucket_reso", "ss_max_bucket_reso", "ss_bucket_info"}  # sd-scripts: "None"/"null"
ADDED = {"modelspec.hash_sha256"}  # sd-scripts leaves it out
ADDED_FLUX = {"ss_t5xxl_max_token_length"}


def _saved_metadata(path) -> dict:
    with safe_open(path, "pt") as f:
        return f.metadata()


def _train(tmp_path, preset, extra, family="sd", bucket=True, sizes=((64, 64),)):
    data = make_dataset(str(tmp_path), n=2, sizes=sizes)
    args = base_args(data, str(tmp_path / "out"), preset=preset, steps=1, extra=extra)
    if not bucket:
        args.remove("--enable_bucket")
    return _saved_metadata(make_trainer(args, family).run())


def test_folder_mode_without_buckets_writes_sd_scripts_keys(tmp_path, tiny_sd1_file):
    """Key by key against sd-scripts for a folder-mode run without bucketing, on a model file:
    no "None,None" timestep range, ss_total_batch_size and the model hashes written, no bucket keys."""
    md = _train(tmp_path, tiny_sd1_file, ["--gradient_accumulation_steps", "2", "--train_batch_size", "3"],
                bucket=False)
    expected = (SD_SCRIPTS_COMMON | SD_SCRIPTS_FLAT | SD_SCRIPTS_MODEL_FILE | {"modelspec.prediction_type"}) \
        - NOT_WRITTEN - BUCKETING_OFF | ADDED
    assert set(md) == expected, (sorted(set(md) - expected), sorted(expected - set(md)))
    assert "modelspec.timestep_range" not in md
    assert md["ss_total_batch_size"] == "6"  # 3 per device x 1 process x 2 accumulated
    assert md["ss_enable_bucket"] == "False" and md["ss_bucket_no_upscale"] == "False"
    with open(tiny_sd1_file, "rb") as f:
        blob = f.read()
    assert md["ss_new_sd_model_hash"] == hashlib.sha256(blob).hexdigest()
    assert md["ss_sd_model_hash"] == hashlib.sha256(blob[0x100000:0x110000]).hexdigest()[:8]
    assert md["ss_sd_model_name"] == os.path.basename(tiny_sd1_file)
    assert md["ss_network_module"] == "networks.lora" and md["ss_network_alpha"] == "4.0"


def test_dataset_config_with_buckets_and_timesteps(tmp_path):
    """With --dataset_config, sd-scripts writes ss_datasets and no flat keys (no top-level
    ss_bucket_info, no ss_total_batch_size); a preset has no file to hash; a set timestep bound is written."""
    make_dataset(str(tmp_path), n=2)
    config = tmp_path / "d.toml"
    config.write_text(f"""
[general]
caption_extension = ".txt"
enable_bucket = true
min_bucket_reso = 64
max_bucket_reso = 128
[[datasets]]
resolution = 64
[[datasets.subsets]]
image_dir = "{tmp_path / 'train' / '5_sks toy'}"
num_repeats = 2
""")
    args = ["--pretrained_model_name_or_path", "tiny:sd1", "--dataset_config", str(config),
            "--max_data_loader_n_workers", "0", "--network_module", "networks.lora", "--network_dim", "4",
            "--max_train_steps", "1", "--seed", "1", "--output_dir", str(tmp_path / "out"), "--output_name", "lora",
            "--max_timestep", "900", "--clip_skip", "2"]
    md = _saved_metadata(make_trainer(args).run())
    expected = (SD_SCRIPTS_COMMON | SD_SCRIPTS_CONFIG | {"modelspec.prediction_type", "modelspec.timestep_range",
                                                         "modelspec.encoder_layer"}) - NOT_WRITTEN | ADDED
    assert set(md) == expected, (sorted(set(md) - expected), sorted(expected - set(md)))
    assert md["modelspec.timestep_range"] == "0,900"  # sd-scripts fills a missing bound with 0 / 1000
    assert md["ss_sd_model_name"] == "tiny:sd1"  # not a path: written as given, as sd-scripts
    [ds] = json.loads(md["ss_datasets"])
    assert ds["enable_bucket"] is True and ds["min_bucket_reso"] == 64 and ds["bucket_info"]["buckets"]


def test_bucket_keys_in_folder_mode_only_with_bucketing(tmp_path):
    """With bucketing on, folder mode writes the three bucket keys (and off: see above);
    in ss_datasets, bucketing off gives nulls, as sd-scripts."""
    from library.data.dataset import build_training_data
    from library.data.options import DataOptions
    from library.data.plan import DataFamilyInfo

    data_dir = make_dataset(str(tmp_path), n=2, sizes=((64, 64),))
    family = DataFamilyInfo(bucket_reso_multiple=64, latent_cache_arch="_sd", vae_scale_factor=8, latent_channels=4)
    common = dict(train_data_dir=data_dir, resolution="64", caption_extension=".txt", seed=1, min_bucket_reso=64,
                  max_bucket_reso=128)
    on = build_training_data(DataOptions(enable_bucket=True, **common), family).metadata()
    assert json.loads(on["ss_bucket_info"])["buckets"] and on["ss_min_bucket_reso"] == "64"
    assert on["ss_max_bucket_reso"] == "128"
    off = build_training_data(DataOptions(enable_bucket=False, bucket_no_upscale=True, **common), family).metadata()
    assert not BUCKETING_OFF & set(off) and off["ss_bucket_no_upscale"] == "False"

    config = tmp_path / "d.toml"
    config.write_text(f'[[datasets]]\nresolution = 64\ncaption_extension = ".txt"\n'
                      f'[[datasets.subsets]]\nimage_dir = "{data_dir}/5_sks toy"\n')
    md = build_training_data(DataOptions(dataset_config=str(config), seed=1), family).metadata()
    [ds] = json.loads(md["ss_datasets"])
    assert (ds["enable_bucket"], ds["min_bucket_reso"], ds["max_bucket_reso"], ds["bucket_info"]) == (
        False, None, None, None)
    assert "ss_bucket_info" not in md


def test_timestep_range_is_never_none_none():
    """modelspec.timestep_range is left out without a timestep range, never the literal "None,None"."""
    assert timestep_range(None, None) is None
    assert timestep_range(100, None) == (100, 1000) and timestep_range(None, 500) == (0, 500)
    md = M.modelspec_metadata("stable-diffusion-v1", "diffusers", "x", 512, timestep_range=(None, None))
    assert "modelspec.timestep_range" not in md


def test_model_hashes_are_cached_by_path_mtime_and_size(tmp_path, monkeypatch):
    """Model hashes are cached by path, mtime and size: a multi-GB checkpoint is not re-read at every save or run."""
    monkeypatch.setenv("LORA_TOOLKIT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.safetensors"
    blob = os.urandom(0x120000)
    path.write_bytes(blob)
    reads = []
    full = hashes.file_sha256
    monkeypatch.setattr(hashes, "file_sha256", lambda p, *a: reads.append(p) or full(p, *a))
    expected = (hashlib.sha256(blob[0x100000:0x110000]).hexdigest()[:8], hashlib.sha256(blob).hexdigest())
    assert hashes.cached_file_hashes(str(path)) == expected
    assert hashes.cached_file_hashes(str(path)) == expected
    hashes.forget_file_hashes()  # a new process: the JSON cache answers
    assert hashes.cached_file_hashes(str(path)) == expected
    assert len(reads) == 1
    os.utime(path, ns=(1, 1))  # touched (or replaced): hashed again
    assert hashes.cached_file_hashes(str(path)) == expected and len(reads) == 2
    blob2 = os.urandom(0x120000)
    path.write_bytes(blob2)
    assert hashes.cached_file_hashes(str(path))[1] == hashlib.sha256(blob2).hexdigest()


@pytest.mark.parametrize("name", ["networks.lora", "networks.lora_flux", "networks.lora_sd3",
                                  "networks.lora_lumina", "networks.lora_anima"])
def test_sd_scripts_lora_module_names_are_the_own_lora(name):
    """sd-scripts' LoRA module names (`--network_module networks.lora_flux`, its FLUX.1 command line) select the
    project's own LoRA."""
    kind = network_kind(name)
    assert isinstance(kind, OwnLoRA) and kind.module.__name__ == "networks.lora"


def test_flux_lora_files_say_networks_lora_flux(tmp_path):
    """FLUX.1 LoRA files say ss_network_module networks.lora_flux, as sd-scripts' do.
    Also key by key against sd-scripts' flux_train_network.py."""
    md = _train(tmp_path, "tiny:flux", ["--network_module", "networks.lora_flux", "--t5xxl_max_token_length", "16",
                                        "--network_train_unet_only", "--bucket_reso_steps", "32"], family="flux")
    assert md["ss_network_module"] == "networks.lora_flux"
    expected = (SD_SCRIPTS_COMMON | SD_SCRIPTS_FLAT | SD_SCRIPTS_FLUX) - NOT_WRITTEN | ADDED | ADDED_FLUX
    assert set(md) == expected, (sorted(set(md) - expected), sorted(expected - set(md)))
    assert md["ss_model_type"] == "flux"


def test_sd_files_say_networks_lora_whatever_alias_was_given(tmp_path):
    """The value is the family's (ModelFamily.lora_network_module), not the alias typed."""
    md = _train(tmp_path, "tiny:sd1", ["--network_module", "networks.lora_flux"])
    assert md["ss_network_module"] == "networks.lora"
