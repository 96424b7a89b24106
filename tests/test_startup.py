"""Start-up imports only what the run uses (issue 28): the quickstart's modules, and the diffusers loader's
deferred packages and peft / bitsandbytes stand-ins (library/families/common/diffusers_import.py).

Each check runs in a fresh interpreter: what a process imported is the thing under test, and pytest's own
process has imported everything other tests needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")

# Modules the SD 1.x quickstart has no use for (exact names): other models' diffusers files, other families'
# text encoders, peft / bitsandbytes (diffusers imports them only to bind names), data sets and wandb (not asked).
NOT_IMPORTED = (
    "peft",
    "bitsandbytes",
    "datasets",
    "wandb",
    "diffusers.models.transformers.transformer_flux",
    "diffusers.models.transformers.transformer_sd3",
    "diffusers.models.unets.unet_3d_condition",
    "diffusers.models.autoencoders.autoencoder_kl_wan",
    "diffusers.models.autoencoders.autoencoder_kl_qwenimage",
    "diffusers.models.controlnets.controlnet",
    "transformers.models.t5.modeling_t5",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.gemma2.modeling_gemma2",
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
)
# ... and what it must have imported (the run did happen).
IMPORTED = ("diffusers.models.unets.unet_2d_condition", "diffusers.models.autoencoders.autoencoder_kl",
            "transformers.models.clip.modeling_clip", "networks.lora", "torch.utils.tensorboard")

_RUN_AND_LIST = """
import atexit, json, runpy, sys
out = sys.argv[1]
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
sys.argv = ["train_network.py"] + sys.argv[2:]
sys.path.insert(0, ".")
runpy.run_path("train_network.py", run_name="__main__")
"""


def _python(code: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def test_quickstart_imports_only_what_it_uses(tmp_path):
    listing = tmp_path / "modules.json"
    out = tmp_path / "out"
    proc = _python(_RUN_AND_LIST, str(listing), "--config_file", "examples/quickstart_sd.toml", "--max_train_steps",
                   "1", "--lr_warmup_steps", "0", "--output_dir", str(out), "--logging_dir", str(out / "logs"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "quickstart_lora.safetensors").is_file()
    modules = set(json.loads(listing.read_text()))
    assert [m for m in IMPORTED if m not in modules] == []
    assert [m for m in NOT_IMPORTED if m in modules] == []


_DEFERRED = """
import sys
import torch
from library.families.common import diffusers_import as di

AutoencoderKL, UNet = di.diffusers_classes("AutoencoderKL", "UNet2DConditionModel")
assert AutoencoderKL.__module__ == "diffusers.models.autoencoders.autoencoder_kl", AutoencoderKL.__module__
assert UNet.__module__ == "diffusers.models.unets.unet_2d_condition", UNet.__module__
deferred = [p for p in ("autoencoders", "unets", "transformers", "controlnets")
            if di.is_deferred("diffusers.models." + p)]
assert deferred == ["autoencoders", "unets", "transformers", "controlnets"], deferred
assert "diffusers.models.autoencoders.autoencoder_tiny" not in sys.modules
assert "diffusers.models.transformers.transformer_flux" not in sys.modules
assert "peft" not in sys.modules and "bitsandbytes" not in sys.modules

# every name diffusers exports is still there: the first one a deferred package lacks runs its __init__
import diffusers
import diffusers.models.autoencoders as autoencoders
assert autoencoders.AutoencoderTiny is diffusers.AutoencoderTiny
assert not di.is_deferred("diffusers.models.autoencoders")
assert autoencoders.AutoencoderKL is AutoencoderKL  # the module already imported is reused, not run again
from diffusers.models.transformers import FluxTransformer2DModel
assert FluxTransformer2DModel.__module__ == "diffusers.models.transformers.transformer_flux"
assert not di.is_deferred("diffusers.models.transformers")
import diffusers.models.unets as unets
assert unets.UNet2DConditionModel is UNet
try:
    unets.NoSuchModel
except AttributeError as e:
    assert "NoSuchModel" in str(e)
else:
    raise AssertionError("a missing name must raise AttributeError")
assert di.diffusers_class("DDPMScheduler") is diffusers.DDPMScheduler  # not a model: the ordinary import

# peft / bitsandbytes stand-ins: exact until the packages are imported, the real thing after
import diffusers.loaders.lora_base as lora_base
import diffusers.hooks.layerwise_casting as casting
import diffusers.quantizers.bitsandbytes.utils as bnb_utils
import diffusers.utils.peft_utils as peft_utils
assert lora_base.BaseTunerLayer is di.PeftBaseTunerLayer and casting.BaseTunerLayer is di.PeftBaseTunerLayer
assert not isinstance(torch.nn.Linear(2, 2), lora_base.BaseTunerLayer)
unet = UNet(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(8, 16), layers_per_block=1,
            norm_num_groups=8, cross_attention_dim=8, attention_head_dim=2,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"))
unet(torch.zeros(1, 4, 8, 8), 1, encoder_hidden_states=torch.zeros(1, 3, 8))  # its forward scales LoRA layers
assert "peft" not in sys.modules, "a U-Net forward imported peft"

import peft
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer
model = inject_adapter_in_model(LoraConfig(r=2, target_modules=["to_q"]), unet)
layer = model.down_blocks[1].attentions[0].transformer_blocks[0].attn1.to_q
assert isinstance(layer, BaseTunerLayer)
assert isinstance(layer, lora_base.BaseTunerLayer) and issubclass(type(layer), casting.BaseTunerLayer)
scaling = layer.scaling["default"]
peft_utils.scale_lora_layers(unet, 0.5)
assert layer.scaling["default"] == scaling * 0.5, (layer.scaling, scaling)
peft_utils.unscale_lora_layers(unet, 0.5)
assert layer.scaling["default"] == scaling, (layer.scaling, scaling)
assert casting.disable_input_dtype_casting.__module__ == "library.families.common.diffusers_import"
with casting.disable_input_dtype_casting(layer):
    pass
import bitsandbytes
assert bnb_utils.bnb.nn.Linear4bit is bitsandbytes.nn.Linear4bit
print("ok")
"""


def test_is_deferred_names_only_a_registered_package_not_yet_run():
    from library.families.common.diffusers_import import is_deferred

    assert is_deferred("library.no_such_package") is False
    assert is_deferred("library") is False  # imported the ordinary way


def test_deferred_packages_and_peft_stand_ins():
    proc = _python(_DEFERRED)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


_OPT_OUT = """
import sys
from library.families.common.diffusers_import import diffusers_class, is_deferred
unet = diffusers_class("UNet2DConditionModel")
import diffusers
assert unet is diffusers.UNet2DConditionModel
print("deferred" if is_deferred("diffusers.models.autoencoders") else "eager",
      "transformer_flux" if "diffusers.models.transformers.transformer_flux" in sys.modules else "-")
"""


def test_plain_import_opt_out_runs_diffusers_own_packages():
    """LORA_TOOLKIT_PLAIN_DIFFUSERS_IMPORT=1 imports through diffusers' own packages: nothing deferred, the sibling
    models imported as diffusers does; without it the same class comes from its own file alone."""
    plain = subprocess.run([sys.executable, "-c", _OPT_OUT], cwd=REPO, capture_output=True, text=True, timeout=300,
                           env=dict(ENV, LORA_TOOLKIT_PLAIN_DIFFUSERS_IMPORT="1"))
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert plain.stdout.split() == ["eager", "transformer_flux"]
    deferred = _python(_OPT_OUT)
    assert deferred.returncode == 0, deferred.stderr[-3000:]
    assert deferred.stdout.split() == ["deferred", "-"]
