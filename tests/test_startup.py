"""Start-up imports only what the run uses (issue 28): the quickstart's modules, the diffusers loader's
deferred packages and peft / bitsandbytes stand-ins (library/families/common/diffusers_import.py), and the torchao /
scipy stand-ins in transformers and diffusers (library/families/common/deferred_backends.py).

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
# text encoders, peft / bitsandbytes / torchao / scipy (transformers and diffusers import them only to bind names),
# data sets and wandb (not asked).
NOT_IMPORTED = (
    "peft",
    "bitsandbytes",
    "torchao",
    "scipy",
    "datasets",
    "wandb",
    "boto3.session",  # TensorBoard's file layer binds boto3, imported lazily (deferred_backends.LAZY)
    "botocore.session",
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
      "transformer_flux" if "diffusers.models.transformers.transformer_flux" in sys.modules else "-",
      *[p if p in sys.modules else "-" for p in ("torchao", "scipy")])
"""


def test_plain_import_opt_out_runs_diffusers_own_packages():
    """LORA_TOOLKIT_PLAIN_DIFFUSERS_IMPORT=1 imports through diffusers' own packages: nothing deferred, the sibling
    models, torchao and scipy imported as diffusers and transformers do; without it the same class comes from its
    own file alone, and neither torchao nor scipy is imported."""
    plain = subprocess.run([sys.executable, "-c", _OPT_OUT], cwd=REPO, capture_output=True, text=True, timeout=300,
                           env=dict(ENV, LORA_TOOLKIT_PLAIN_DIFFUSERS_IMPORT="1"))
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert plain.stdout.split() == ["eager", "transformer_flux", "torchao", "scipy"]
    deferred = _python(_OPT_OUT)
    assert deferred.returncode == 0, deferred.stderr[-3000:]
    assert deferred.stdout.split() == ["deferred", "-", "-", "-"]


_BACKENDS = """
import sys
import torch
import library.families  # noqa: F401  (installs the finder, as every run does before a model import)
from transformers.models.clip.modeling_clip import CLIPTextModel
from library.families.common.diffusers_import import diffusers_classes
diffusers_classes("UNet2DConditionModel", "AutoencoderKL")  # imports single_file_utils and its schedulers
import transformers.utils as tu, transformers.utils.import_utils as tiu
import diffusers.utils as du, diffusers.utils.import_utils as diu
import transformers.quantizers.quantizer_torchao as tq
import diffusers.quantizers.torchao.torchao_quantizer as dq
import diffusers.schedulers.scheduling_euler_discrete as euler
import diffusers.schedulers.scheduling_lms_discrete as lms
from library.families.common.deferred_backends import RULES
losses = [sys.modules[m] for m in RULES if m.startswith("transformers.loss.")]
assert len(losses) == 6, losses
assert [m for m in sys.modules if m.split(".")[0] in ("torchao", "scipy")] == []

# the availability functions are the real ones again, everywhere, and answer "available"
assert tu.is_torchao_available is tiu.is_torchao_available is tq.is_torchao_available
assert tu.is_scipy_available is tiu.is_scipy_available
assert all(m.is_scipy_available is tiu.is_scipy_available for m in losses)
assert du.is_torchao_available is diu.is_torchao_available is dq.is_torchao_available
assert du.is_scipy_available is diu.is_scipy_available is euler.is_scipy_available is lms.is_scipy_available
assert tu.is_torchao_available() is True and tu.is_scipy_available() is True
assert du.is_torchao_available() is True and du.is_scipy_available() is True
import diffusers
assert diffusers.LMSDiscreteScheduler.__module__ == "diffusers.schedulers.scheduling_lms_discrete"  # not a dummy

# scipy stand-ins resolve to scipy's own objects, imported on use
cost = torch.tensor([[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0], [1.0, 6.0, 0.5]])
rows, cols = losses[0].linear_sum_assignment(cost)
assert "scipy.optimize" in sys.modules
from scipy.optimize import linear_sum_assignment
want = linear_sum_assignment(cost)
assert (rows.tolist(), cols.tolist()) == (want[0].tolist(), want[1].tolist()) == ([1, 2, 3], [1, 2, 0]), (rows, cols)
assert all([c.tolist() for c in m.linear_sum_assignment(cost)] == [[1, 2, 3], [1, 2, 0]] for m in losses)
import scipy.integrate, scipy.stats
assert euler.scipy.stats is scipy.stats and lms.integrate.quad is scipy.integrate.quad
s = euler.EulerDiscreteScheduler(use_beta_sigmas=True)
s.set_timesteps(4)  # scipy.stats.beta.ppf through the stand-in
assert s.sigmas.shape == (5,) and float(s.sigmas[-1]) == 0.0, s.sigmas
s = lms.LMSDiscreteScheduler()
s.set_timesteps(4)
x = torch.ones(1, 1, 2, 2)
out = s.step(torch.ones(1, 1, 2, 2), s.timesteps[0], x).prev_sample  # integrate.quad through the stand-in
assert torch.isfinite(out).all()

# torchao stand-ins: nothing of torchao exists before its import, the real thing after
assert not isinstance(object(), dq.FqnToConfig) and "torchao" not in sys.modules
uints = [(getattr(torch, f"uint{n}"), f"torch.uint{n}") for n in range(1, 8)]
assert all(u in torch.serialization.get_safe_globals() for u in uints)  # at diffusers' import, as it does
from library.families.common import deferred_backends
assert [a.__name__ for a in deferred_backends._ON_IMPORT["torchao"]] == ["_update_torch_safe_globals"]
import torchao
assert "torchao" not in deferred_backends._ON_IMPORT  # diffusers' registration of torchao's classes ran
import torchao.quantization as q
cfg = q.FqnToConfig({"_default": q.Int8WeightOnlyConfig()})
assert isinstance(cfg, dq.FqnToConfig) and issubclass(q.FqnToConfig, dq.FqnToConfig)
assert dq.quantize_.resolve() is q.quantize_
from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict
sd = {"w": torch.arange(6.0).reshape(2, 3)}
got, want = tq.flatten_tensor_state_dict(sd), flatten_tensor_state_dict(sd)
assert got[1] == want[1] and list(got[0]) == list(want[0]) and torch.equal(got[0]["w"], want[0]["w"]), (got, want)
assert dq.flatten_tensor_state_dict.resolve() is flatten_tensor_state_dict
lin = torch.nn.Sequential(torch.nn.Linear(8, 4))
ref = torch.nn.Sequential(torch.nn.Linear(8, 4))
ref.load_state_dict(lin.state_dict())
dq.quantize_(lin, q.Int8WeightOnlyConfig())
q.quantize_(ref, q.Int8WeightOnlyConfig())
x = torch.randn(2, 8)
assert type(lin[0].weight) is type(ref[0].weight) and torch.equal(lin(x), ref(x))
print("ok")
"""


def test_torchao_and_scipy_stand_ins_resolve_to_the_real_objects():
    proc = _python(_BACKENDS)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


_BOTO3 = """
import sys
import torch
import library.families  # noqa: F401  (installs the finder)
import accelerate
from accelerate import Accelerator  # noqa: F401  (imports accelerate.commands.config.sagemaker)
import accelerate.commands.config.sagemaker as sagemaker
from accelerate.utils import imports
assert [m for m in sys.modules if m.split(".")[0] in ("boto3", "botocore")] == []
assert sagemaker.is_boto3_available is imports.is_boto3_available and imports.is_boto3_available() is True
import boto3
assert sagemaker.boto3.client is boto3.client and sagemaker.boto3.Session is boto3.Session
print("ok")
"""


def test_accelerate_imports_boto3_only_when_used():
    """accelerate's SageMaker config imports boto3 (about 10 MiB) when it is installed; a run that never configures
    SageMaker (and logs to no S3 path through TensorBoard, whose own file layer imports it) does not."""
    proc = _python(_BOTO3)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


_TENSORBOARD_BOTO3 = """
import sys
import torch
import library.families  # noqa: F401  (installs the finder)
from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (what accelerate's TensorBoard tracker imports)
from tensorboard.compat.tensorflow_stub.io import gfile
from library.families.common.deferred_backends import LAZY
assert LAZY[gfile.__name__] == ("boto3",)
lazy = sys.modules["boto3"]
assert gfile.boto3 is lazy and type(lazy).__name__ == "_LazyModule"  # bound, its code not run
assert [m for m in sys.modules if m.startswith(("boto3.", "botocore.session"))] == []
assert gfile.S3_ENABLED and type(gfile.get_filesystem("s3://bucket/logs")).__name__ == "S3FileSystem"  # as before
client = gfile.boto3.client  # the first attribute runs boto3's own code, in place
assert type(lazy) is type(sys) and sys.modules["boto3"] is lazy and "boto3.session" in sys.modules
import boto3
assert boto3 is lazy and client is boto3.client and boto3.Session.__module__ == "boto3.session"
print("ok")
"""


def test_tensorboard_imports_boto3_lazily():
    """TensorBoard's file layer imports boto3 (about 10 MiB) for s3:// paths: the module is bound (so S3 paths
    work as before) but its code runs only when something uses it."""
    proc = _python(_TENSORBOARD_BOTO3)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def _bound_under_flag(path: str, flag: str) -> tuple[set[str], list[str]]:
    """Names a module binds by import inside a top-level `if` that calls `flag`, and the calls it makes there."""
    import ast

    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names: set[str] = set()
    calls: list[str] = []
    for node in tree.body:
        if not isinstance(node, ast.If) or flag not in ast.unparse(node.test):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in sub.names}
            elif isinstance(sub, ast.Expr) and isinstance(sub.value, ast.Call):
                calls.append(ast.unparse(sub.value))
    return names, calls


def test_rules_name_every_binding_of_the_installed_modules():
    """Each rule stands in for exactly the names its module binds under the flag (installed transformers /
    diffusers source), and every module of the packages the rules cover that binds torchao or scipy so has a rule."""
    import glob
    import importlib
    import importlib.util

    from library.families.common.deferred_backends import RULES

    for name, rule in RULES.items():
        flags = importlib.import_module(rule.flags)  # what the stand-ins ask of the module: the flags it imports
        names, calls = _bound_under_flag(importlib.util.find_spec(name).origin, rule.flag)
        assert set(rule.stand_ins(flags)) == names, name
        want_calls = ["_update_torch_safe_globals()"] if name.endswith("torchao_quantizer") else []
        assert calls == want_calls and (rule.on_import is not None) == bool(calls), (name, calls)
    covered = {"transformers.loss", "transformers.quantizers", "diffusers.schedulers", "diffusers.quantizers.torchao",
               "accelerate.commands.config"}
    found = set()
    for package in covered:
        folder = os.path.dirname(importlib.util.find_spec(package).origin)
        for path in glob.glob(os.path.join(folder, "*.py")):
            for flag in ("is_scipy_available", "is_torchao_available", "is_boto3_available"):
                if _bound_under_flag(path, flag)[0]:
                    found.add(f"{package}.{os.path.basename(path)[:-3]}")
    assert found == set(RULES), sorted(found ^ set(RULES))
