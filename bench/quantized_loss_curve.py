"""LoRA loss curves on tiny:flux over --steps steps with --base_model_precision values against no_change.

Same data, seed and flags for every run (bf16 mixed precision, cached text outputs, gradient checkpointing);
prints the loss averaged over windows of --window steps for each value, and the largest relative difference of
those window means from no_change after step 50 (issue 26: int8 within 2%).

    python bench/quantized_loss_curve.py [--values int8-quanto nf4-bnb gguf-Q8_0 gguf-Q4_0] [--steps 200] [--window 25]

`gguf-Q8_0` / `gguf-Q4_0`: tiny:flux written as BFL files (tools/make_tiny_model.py: the preset's weights) and its
transformer as a ComfyUI-GGUF file (library/families/common/gguf_file.py write_gguf), trained from that file.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.train_helpers import base_args, make_dataset, make_trainer  # noqa: E402


def gguf_model(root: str, value: str) -> list[str]:
    """--pretrained_model_name_or_path and the component flags of tiny:flux as a `value` (gguf-Q8_0 ...) file."""
    from safetensors.torch import load_file

    from library.families.common.gguf_file import write_gguf
    from tools.make_tiny_model import main as make_tiny

    files = os.path.join(root, "bfl")
    if not os.path.isdir(files):
        assert make_tiny(["--family", "flux", "--out", files, "--single_file"]) == 0
    path = os.path.join(files, f"flux1-tiny-{value}.gguf")
    write_gguf(path, load_file(os.path.join(files, "flux1-tiny.safetensors")), value[len("gguf-"):], "flux")
    return ["--pretrained_model_name_or_path", path,
            *[a for flag in ("clip_l", "t5xxl", "ae") for a in (f"--{flag}", os.path.join(files, f"{flag}.safetensors"))]]


def losses(root: str, data: str, value: str, steps: int) -> list[float]:
    extra = ["--t5xxl_max_token_length", "16", "--network_train_unet_only", "--cache_text_encoder_outputs",
             "--gradient_checkpointing", "--mixed_precision", "bf16"]
    extra += gguf_model(root, value) if value.startswith("gguf-") else ["--base_model_precision", value]
    trainer = make_trainer(base_args(data, os.path.join(root, value), "tiny:flux", steps=steps, extra=extra), "flux")
    out: list[float] = []
    step = trainer._micro_step
    trainer._micro_step = lambda *a: out.append(step(*a)) or out[-1]
    trainer.run()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--values", nargs="*", default=["int8-quanto", "int8-torchao", "int4-quanto", "nf4-bnb"])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--window", type=int, default=25)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        data = make_dataset(os.path.join(root, "data"), n=8)
        curves = {v: losses(root, data, v, a.steps) for v in ["no_change", *a.values]}
    w = a.window
    means = {v: [sum(c[i:i + w]) / len(c[i:i + w]) for i in range(0, len(c), w)] for v, c in curves.items()}
    print("steps      " + "".join(f"{v:>14}" for v in means))
    for i in range(len(means["no_change"])):
        print(f"{i * w + 1:>4}-{min((i + 1) * w, a.steps):<5} " + "".join(f"{m[i]:>14.4f}" for m in means.values()))
    base = curves["no_change"]
    for v in a.values:
        after = [abs(x - y) / y for x, y in zip(means[v][50 // w:], means["no_change"][50 // w:])]
        mean_after = sum(curves[v][50:]) / len(curves[v][50:])
        print(f"{v}: window means after step 50 differ from no_change by at most {max(after) * 100:.2f}%; "
              f"mean loss after step 50 {mean_after:.4f} vs {sum(base[50:]) / len(base[50:]):.4f}")


if __name__ == "__main__":
    main()
