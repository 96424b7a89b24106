from setuptools import find_packages, setup

# Optional packages, by what they add (pip install .[lycoris,optim]); docs/README "Install" explains the split.
# Each is imported only when a flag asks for it, and a missing one is a one-line error naming the pip command.
EXTRAS = {
    # --network_module lycoris.kohya (LoHa, LoKr, LoCon, ...)
    "lycoris": ["lycoris-lora>=3.1"],
    # --optimizer_type AdamW8bit / PagedAdamW* / Lion8bit / SGDNesterov8bit, Prodigy, Lion, DAdapt*, *ScheduleFree
    "optim": ["bitsandbytes>=0.45", "prodigyopt", "lion-pytorch", "dadaptation", "schedulefree"],
    # --base_model_precision / --text_encoder_precision (docs/quantization.md): int8/int4/fp8 by optimum-quanto,
    # int8/fp8 by torchao, nf4 by bitsandbytes; GGUF base files (.gguf) read by gguf
    "quantize": ["optimum-quanto>=0.2.7", "torchao>=0.18", "bitsandbytes>=0.45", "gguf>=0.10"],
    # --xformers (CUDA only; PyTorch SDPA is used without it)
    "xformers": ["xformers"],
    # --log_with wandb / all (Weights & Biases; WANDB_MODE=offline logs to files without an account)
    "wandb": ["wandb"],
    # --deepspeed / an accelerate DeepSpeed config (docs/distributed.md); install with DS_BUILD_OPS=0
    "deepspeed": ["deepspeed"],
    # python webui.py: the training-job web UI (docs/webui.md)
    "webui": ["fastapi", "uvicorn"],
}
EXTRAS["all"] = sorted({p for name, pkgs in EXTRAS.items() if name != "xformers" for p in pkgs})

setup(
    name="lora-trainer-toolkit",
    version="0.1.0",
    description="LoRA / LyCORIS and fine-tune training for SD 1.x/2.x, SDXL and FLUX.1, sd-scripts compatible",
    packages=find_packages(include=["library", "library.*", "networks", "networks.*"]),
    python_requires=">=3.10",
    install_requires=[line.strip() for line in open("requirements.txt") if line.strip() and not line.startswith("#")],
    extras_require=EXTRAS,
)
