"""--context_parallel_size: each sample's tokens split over processes through the denoiser's diffusers plan
(library/train/distributed/context_parallel.py). Two CPU processes (gloo) train the FLUX.1 LoRA that one
process trains; the checks before loading name what is in the way."""

from __future__ import annotations

import os

import pytest

from library.core.errors import UserError
from library.families import get_family
from library.train.distributed.context_parallel import context_parallel_problem, data_rank
from tests.distributed_helpers import dataset, launch, needs_torchrun
from tests.train_helpers import make_trainer

FLUX_FLAGS = ["--t5xxl_max_token_length", "16", "--network_module", "networks.lora_flux", "--network_dim", "4",
              "--network_alpha", "4", "--network_train_unet_only", "--guidance_scale", "1.0"]


def flux_args(data: str, out: str, steps: int, extra=()) -> list[str]:
    return ["--pretrained_model_name_or_path", "tiny:flux", "--train_data_dir", data, "--caption_extension", ".txt",
            "--resolution", "64", "--train_batch_size", "1", "--max_data_loader_n_workers", "0",
            "--learning_rate", "1e-3", "--max_train_steps", str(steps), "--seed", "123", "--cpu",
            "--output_dir", out, "--output_name", "lora", *FLUX_FLAGS, *extra]


def test_data_is_shared_out_over_the_data_parallel_groups():
    # 4 processes in groups of 2: ranks 0, 1 train data share 0 of 2; ranks 2, 3 share 1
    assert [data_rank(r, 4, 2) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [data_rank(r, 2, 1) for r in range(2)] == [(0, 2), (1, 2)]


def test_what_is_in_the_way_is_named_in_one_line():
    flux = get_family("flux")
    ok = dict(token_pixels=flux.context_parallel_token_pixels, family="flux", buckets=[(64, 64), (128, 64)])
    assert context_parallel_problem(2, 2, **ok) is None
    assert context_parallel_problem(1, 1, None, "sd", [(64, 48)]) is None  # off: nothing is checked
    assert context_parallel_problem(2, 2, None, "sdxl", [(64, 64)]) == (
        "--context_parallel_size 2: sdxl's denoiser has no context-parallel plan in diffusers (FLUX.1, FLUX.2 and "
        "Qwen-Image have; see docs/distributed.md)")
    assert get_family("chroma").context_parallel_token_pixels is None
    assert context_parallel_problem(2, 3, **ok) == \
        "--context_parallel_size 2: the 3 process(es) must be a multiple of it"
    assert context_parallel_problem(2, 2, **ok, blocks_to_swap=4) == (
        "--context_parallel_size 2: not with --blocks_to_swap (the split runs around the denoiser's own attention; "
        "use DDP)")
    assert "not with FSDP" in context_parallel_problem(2, 2, **ok, fsdp=True)
    assert "not with DeepSpeed" in context_parallel_problem(2, 2, **ok, deepspeed=True)
    assert "not with --torch_compile" in context_parallel_problem(2, 2, **ok, compile=True)
    from library.families.flux.options import FluxOptions

    masked = flux.context_parallel_refusal(FluxOptions(apply_t5_attn_mask=True))
    assert flux.context_parallel_refusal(FluxOptions()) is None
    assert context_parallel_problem(2, 2, **ok, family_refusal=masked) == (
        "--context_parallel_size 2: not with --apply_t5_attn_mask (diffusers' token split does not carry the "
        "attention mask)")
    odd = {**ok, "buckets": [(64, 64), (48, 80)]}  # 3 x 5 = 15 tokens
    assert context_parallel_problem(2, 2, **odd) == (
        "--context_parallel_size 2: the 48x80 bucket has 15 image tokens, not divisible by 2; choose resolutions / "
        "bucket steps whose token grid (1 token per 16 px) divides")
    assert get_family("flux").facts()["context_parallel"] is True and get_family("flux2").facts()["context_parallel"]
    assert get_family("qwen_image").facts()["context_parallel"] is True
    assert get_family("sd").facts()["context_parallel"] is False


def test_a_family_without_a_plan_is_refused_before_training(tmp_path):
    data = dataset(str(tmp_path), n=2)
    from tests.distributed_helpers import train_args

    trainer = make_trainer(train_args(data, str(tmp_path / "out"), str(tmp_path / "logs"), steps=1,
                                      extra=["--cp_size", "2"]))
    with pytest.raises(UserError, match="^--context_parallel_size 2: sd's denoiser has no context-parallel plan"):
        trainer.run()
    assert not os.path.exists(tmp_path / "out" / "lora.safetensors")


FLUX2_FLAGS = ["--network_module", "networks.lora_flux2", "--network_dim", "4", "--network_alpha", "4",
               "--qwen3_max_token_length", "16", "--network_train_unet_only"]


@needs_torchrun
def test_flux2_two_processes_train_the_lora_of_one(tmp_path):
    """FLUX.2 [klein] through its own diffusers plan (text padded to --qwen3_max_token_length, 16 here)."""
    from safetensors.torch import load_file

    tmp = str(tmp_path)
    data = dataset(tmp, n=4)

    def args(out, extra=()):
        argv = flux_args(data, out, steps=3, extra=extra)
        argv[argv.index("tiny:flux")] = "tiny:flux2"
        start = argv.index("--t5xxl_max_token_length")
        return argv[:start] + FLUX2_FLAGS + list(extra)

    launch(tmp, 1, args(os.path.join(tmp, "cp"), ["--context_parallel_size", "2"]),
           env_extra={"SCRIPT": "flux2_train_network.py"}, timeout=300)
    make_trainer(args(os.path.join(tmp, "one")), "flux2").run()
    cp = load_file(os.path.join(tmp, "cp", "lora.safetensors"))
    one = load_file(os.path.join(tmp, "one", "lora.safetensors"))
    assert cp.keys() == one.keys()
    weights = [k for k in one if not k.endswith("alpha")]
    diff = sum(float((cp[k].double() - one[k].double()).square().sum()) for k in weights) ** 0.5
    norm = sum(float(one[k].double().square().sum()) for k in weights) ** 0.5
    print(f"FLUX.2 relative difference {diff / norm:.3g}")
    assert diff / norm <= 5e-5, diff / norm


@needs_torchrun
def test_two_processes_split_the_tokens_and_train_the_lora_of_one(tmp_path):
    """2 gloo processes with --context_parallel_size 2 (Ulysses: each attends over every token for half of the
    heads) train one batch at a time, and reach the LoRA that 1 process trains on the same batches."""
    from safetensors.torch import load_file

    tmp = str(tmp_path)
    data = dataset(tmp, n=4)
    launch(tmp, 1, flux_args(data, os.path.join(tmp, "cp"), steps=4, extra=["--context_parallel_size", "2",
                                                                           "--logging_dir", os.path.join(tmp, "logs")]),
           env_extra={"SCRIPT": "flux_train_network.py"}, timeout=300)
    make_trainer(flux_args(data, os.path.join(tmp, "one"), steps=4), "flux").run()
    cp = load_file(os.path.join(tmp, "cp", "lora.safetensors"))
    one = load_file(os.path.join(tmp, "one", "lora.safetensors"))
    assert cp.keys() == one.keys() and len(one) == 29 * 3
    weights = [k for k in one if not k.endswith("alpha")]
    diff = sum(float((cp[k].double() - one[k].double()).square().sum()) for k in weights) ** 0.5
    norm = sum(float(one[k].double().square().sum()) for k in weights) ** 0.5
    moved = max(one[k].float().abs().max().item() for k in one if "lora_up" in k)
    print(f"relative difference {diff / norm:.3g}; largest lora_up weight {moved:.3g}")
    assert diff / norm <= 5e-5, diff / norm  # float32 summation order only (measured below in the docs)
    assert moved >= 1e-3


def test_qwen_image_text_is_padded_to_a_multiple_of_the_split_with_masked_tokens():
    import torch

    from library.families.qwen_image.text import trimmed

    mask = torch.zeros(2, 1024, dtype=torch.bool)
    mask[0, :5], mask[1, :3] = True, True
    text = {"prompt_embeds": torch.arange(2 * 1024 * 2, dtype=torch.float32).reshape(2, 1024, 2) * mask[..., None],
            "prompt_mask": mask}
    states, m = trimmed(text)
    assert states.shape == (2, 5, 2) and m.tolist() == [[True] * 5, [True] * 3 + [False] * 2]
    states, m = trimmed(text, 4)  # 5 tokens -> 8: three more, masked, zero
    assert states.shape == (2, 8, 2) and m.sum(1).tolist() == [5, 3] and not m[:, 5:].any()
    assert torch.equal(states[:, :5], text["prompt_embeds"][:, :5]) and not states[:, 5:].any()
    full = {"prompt_embeds": torch.ones(1, 1024, 2), "prompt_mask": torch.ones(1, 1024, dtype=torch.bool)}
    states, m = trimmed(full, 3)  # past the stored 1024: padded beyond it
    assert states.shape == (1, 1026, 2) and m.sum().item() == 1024


QWEN_CAPTIONS = ["sks", "sks toy", "sks toy red", "sks toy red cube"]


@needs_torchrun
def test_qwen_image_two_processes_train_the_lora_of_one(tmp_path):
    """Qwen-Image's text length is its batch's longest caption: captions of 1 to 4 words make it odd and even;
    predict pads it to a multiple of 2 with masked tokens, and 2 gloo processes train the LoRA of one."""
    from safetensors.torch import load_file

    tmp = str(tmp_path)
    data = dataset(tmp, n=4)
    folder = os.path.join(data, "1_sks toy")
    for i, caption in enumerate(QWEN_CAPTIONS):
        with open(os.path.join(folder, f"img{i}.txt"), "w") as f:
            f.write(caption)

    def args(out, extra=()):
        argv = flux_args(data, out, steps=4)
        argv[argv.index("tiny:flux")] = "tiny:qwen_image"
        start = argv.index("--t5xxl_max_token_length")
        return argv[:start] + ["--network_module", "networks.lora_qwen_image", "--network_dim", "4",
                               "--network_alpha", "4", "--network_train_unet_only", *extra]

    launch(tmp, 1, args(os.path.join(tmp, "cp"), ["--context_parallel_size", "2"]),
           env_extra={"SCRIPT": "qwen_image_train_network.py"}, timeout=300)
    make_trainer(args(os.path.join(tmp, "one")), "qwen_image").run()
    cp = load_file(os.path.join(tmp, "cp", "lora.safetensors"))
    one = load_file(os.path.join(tmp, "one", "lora.safetensors"))
    assert cp.keys() == one.keys()
    weights = [k for k in one if not k.endswith("alpha")]
    diff = sum(float((cp[k].double() - one[k].double()).square().sum()) for k in weights) ** 0.5
    norm = sum(float(one[k].double().square().sum()) for k in weights) ** 0.5
    moved = max(one[k].float().abs().max().item() for k in one if "lora_up" in k)
    print(f"Qwen-Image relative difference {diff / norm:.3g}; largest lora_up weight {moved:.3g}")
    assert diff / norm <= 5e-5, diff / norm
    assert moved >= 1e-3
