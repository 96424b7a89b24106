"""torchao, scipy and boto3 kept out of transformers', diffusers' and accelerate's import until something uses
them (issue 28).

Importing a transformers model class (`transformers.modeling_utils`) or a diffusers model class imports, at module
level and only to bind a few names:

- torchao, in `transformers.quantizers.quantizer_torchao` (`flatten_tensor_state_dict`) and
  `diffusers.quantizers.torchao.torchao_quantizer` (`FqnToConfig`, `quantize_`, three safetensors helpers; it also
  registers torchao's tensor classes as torch.load safe globals): about 84 MiB and 1 s of CPU, and "Failed to load
  ... _C_mxfp8" warnings at every start;
- scipy, in transformers' detection losses (`transformers.loss.loss_*`: `linear_sum_assignment`, scipy.optimize)
  and diffusers' schedulers (`scipy` for `scipy.stats.beta.ppf`; the LMS scheduler also `integrate`, from
  single_file_utils, which every diffusers model imports): about 60 MiB;
- boto3, in accelerate's SageMaker config questions (`accelerate.commands.config.sagemaker`, imported by
  `accelerate.utils.other` and so by every `Accelerator`): about 10 MiB and 0.1 s of CPU.

A run that never quantizes with torchao, never uses beta sigmas or a detection loss and never configures SageMaker
needs none of them (TensorBoard's file layer binds boto3 too, for S3 paths: a `LAZY` rule, below).
`install()` (run when `library.families` is imported, before any family imports a model) puts a finder in
`sys.meta_path` that acts only on the modules of `RULES`, when they are first imported: while such a module's own
top-level code runs, the availability function it calls (`is_torchao_available` / `is_scipy_available` of
`transformers.utils` or `diffusers.utils`, `is_boto3_available` of `accelerate.utils.imports`) answers "absent" to
that module only (callers in any other module, among them modules it imports
meanwhile, get the real answer), so it skips the import. Then:

- the real availability functions are put back, in the flags' modules and wherever the module (or one it imported
  meanwhile) bound the stand-in function: the real functions were never called for a hidden answer, so their
  lru_cache holds no false value, and later code (`library/train/memory/quantize.py`'s torchao precisions,
  transformers' `TorchAoHfQuantizer.validate_environment`) sees torchao and scipy as available;
- each name the module would have bound gets an exact stand-in: a function imports the real one on call
  (`linear_sum_assignment`, `quantize_`, ...), a class (`FqnToConfig`) answers `isinstance` / `issubclass` as the
  real one once its module is imported (before that, no instance can exist) and constructs the real one on call,
  a module (`scipy`, `integrate`, `boto3`) is imported on its first attribute (`scipy.stats.beta.ppf` imports
  scipy.stats);
- diffusers' torch.load safe-globals registration registers torch's uint1..7 dtypes at once, as at its import, and
  torchao's tensor classes when torchao is first imported, by anyone (the finder watches that import too):
  diffusers' own torchao loading imports torchao first (`TorchAoConfig` deserializes through `torchao.core`);
  only a bare `torch.load(..., weights_only=True)` of a torchao checkpoint in a process that never imported
  torchao would miss them (import torchao first).

`LAZY` is the other kind of rule, for a module that imports a package unconditionally (in a `try`) only to use it
later: while that module's own code runs, the package is imported through `importlib.util.LazyLoader`, so the
module binds the real package object, in `sys.modules` as usual, whose code runs in place on its first attribute
access (TensorBoard's file layer and boto3, for s3:// log paths).

Nothing is hidden for a package already imported or not installed, a module already imported, or a module whose
flag says "absent" anyway. `LORA_TOOLKIT_PLAIN_DIFFUSERS_IMPORT=1` in the environment turns this off, with
diffusers_import.py's deferral (the opt-out, should a transformers or diffusers release change what it relies on).
The names each rule stands in for are checked against the installed modules' source (tests/test_startup.py).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

PLAIN_IMPORT_ENV = "LORA_TOOLKIT_PLAIN_DIFFUSERS_IMPORT"


class ModuleOnUse:
    """A module imported on its first attribute; `load` is the module to import first (`scipy.stats` for `scipy`,
    where the original did `import scipy.stats`)."""

    def __init__(self, name: str, load: Optional[str] = None) -> None:
        self._name = name
        self._load = load or name

    def __getattr__(self, attr: str) -> Any:
        if attr in ("_name", "_load"):  # not set yet (copy / pickle build the object empty)
            raise AttributeError(attr)
        importlib.import_module(self._load)
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<{self._name}, imported on first use>"


class NameOnUse:
    """A function or class of `module` imported on use: a call calls the real one; `isinstance` / `issubclass`
    answer as the real class once `module` is imported, and False before (no instance of it can exist yet)."""

    def __init__(self, module: str, name: str) -> None:
        self._module = module
        self.__name__ = name

    def resolve(self) -> Any:
        return getattr(importlib.import_module(self._module), self.__name__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def _imported(self) -> Any:
        module = sys.modules.get(self._module)
        return None if module is None else getattr(module, self.__name__, None)

    def __instancecheck__(self, obj: Any) -> bool:
        real = self._imported()
        return real is not None and isinstance(obj, real)

    def __subclasscheck__(self, sub: type) -> bool:
        real = self._imported()
        return real is not None and issubclass(sub, real)

    def __getattr__(self, attr: str) -> Any:
        if attr in ("_module", "__name__"):  # not set yet (copy / pickle build the object empty)
            raise AttributeError(attr)
        return getattr(self.resolve(), attr)

    def __repr__(self) -> str:
        return f"<{self._module}.{self.__name__}, imported on first use>"


@dataclass(frozen=True)
class Rule:
    """One module that binds `package` at import only when the availability function `flag` of the module `flags`
    says so: `stand_ins(module)` gives the names it would have bound, `on_import(module)` what it would have run,
    to run when `package` is imported."""

    flags: str
    flag: str
    package: str
    stand_ins: Callable[[Any], dict[str, Any]]
    on_import: Optional[Callable[[Any], Optional[Callable[[], Any]]]] = None


def _linear_sum_assignment(module: Any) -> dict[str, Any]:
    return {"linear_sum_assignment": NameOnUse("scipy.optimize", "linear_sum_assignment")}


def _scipy_stats(module: Any) -> dict[str, Any]:
    return {"scipy": ModuleOnUse("scipy", "scipy.stats")}


def _scipy_stats_integrate(module: Any) -> dict[str, Any]:
    return {"scipy": ModuleOnUse("scipy", "scipy.stats"), "integrate": ModuleOnUse("scipy.integrate")}


def _boto3(module: Any) -> dict[str, Any]:
    return {"boto3": ModuleOnUse("boto3")}


def _transformers_torchao(module: Any) -> dict[str, Any]:
    return {"flatten_tensor_state_dict": NameOnUse("torchao.prototype.safetensors.safetensors_support",
                                                   "flatten_tensor_state_dict")}


def _diffusers_torchao(module: Any) -> dict[str, Any]:
    if not module.is_torchao_version(">=", "0.15.0"):
        return {}
    names = {"FqnToConfig": NameOnUse("torchao.quantization", "FqnToConfig"),
             "quantize_": NameOnUse("torchao.quantization", "quantize_")}
    if module.is_torchao_version(">=", "0.16.0"):
        support = "torchao.prototype.safetensors.safetensors_support"
        names["flatten_tensor_state_dict"] = NameOnUse(support, "flatten_tensor_state_dict")
        names["unflatten_tensor_state_dict"] = NameOnUse(support, "unflatten_tensor_state_dict")
        names["is_metadata_torchao"] = NameOnUse("torchao.prototype.safetensors.safetensors_utils",
                                                 "is_metadata_torchao")
    return names


def _diffusers_torchao_safe_globals(module: Any) -> Optional[Callable[[], Any]]:
    """diffusers' `_update_torch_safe_globals()`, run at its import under the same condition: torch's own uint1..7
    dtypes now, as it registers them first; the whole function (torchao's tensor classes) once torchao is imported."""
    if (module.is_torch_available() and module.is_torch_version(">=", "2.6.0")
            and module.is_torchao_version(">=", "0.15.0")):
        import torch

        torch.serialization.add_safe_globals([(getattr(torch, f"uint{n}"), f"torch.uint{n}") for n in range(1, 8)])
        return module._update_torch_safe_globals
    return None


_SCIPY_SCHEDULERS = ("deis_multistep", "dpmsolver_multistep", "dpmsolver_multistep_inverse", "dpmsolver_sde",
                     "dpmsolver_singlestep", "euler_discrete", "flow_match_euler_discrete", "flow_match_lcm",
                     "heun_discrete", "k_dpm_2_ancestral_discrete", "k_dpm_2_discrete", "sasolver",
                     "unipc_multistep")
_SCIPY_LOSSES = ("for_object_detection", "deformable_detr", "rt_detr", "rf_detr", "grounding_dino", "lw_detr")

# module -> its rule (checked against transformers 5.23, diffusers 0.42 and accelerate 1.15)
RULES: dict[str, Rule] = {
    "accelerate.commands.config.sagemaker": Rule("accelerate.utils.imports", "is_boto3_available", "boto3", _boto3),
    "transformers.quantizers.quantizer_torchao": Rule("transformers.utils", "is_torchao_available", "torchao",
                                                      _transformers_torchao),
    "diffusers.quantizers.torchao.torchao_quantizer": Rule("diffusers.utils", "is_torchao_available", "torchao",
                                                           _diffusers_torchao, _diffusers_torchao_safe_globals),
    "diffusers.schedulers.scheduling_lms_discrete": Rule("diffusers.utils", "is_scipy_available", "scipy",
                                                         _scipy_stats_integrate),
    **{f"transformers.loss.loss_{n}": Rule("transformers.utils", "is_scipy_available", "scipy",
                                           _linear_sum_assignment) for n in _SCIPY_LOSSES},
    **{f"diffusers.schedulers.scheduling_{n}": Rule("diffusers.utils", "is_scipy_available", "scipy", _scipy_stats)
       for n in _SCIPY_SCHEDULERS},
}

# module -> packages it imports at its top level only to use them later, for something a training run may never
# do: imported lazily while that module's own code runs (importlib.util.LazyLoader: the real module, in
# sys.modules as usual, whose code runs in place on its first attribute access). Checked against tensorboard 2.21.
LAZY: dict[str, tuple[str, ...]] = {
    # TensorBoard's file layer tries `import botocore.exceptions` (cheap) and `import boto3` (about 10 MiB) to offer
    # s3:// log paths; boto3 is used only inside its S3FileSystem's methods
    "tensorboard.compat.tensorflow_stub.io.gfile": ("boto3",),
}
_LAZY_NOW: set[str] = set()  # the LAZY packages of the module running now

# package -> what to run once it is imported (diffusers' torchao safe globals)
_ON_IMPORT: dict[str, list[Callable[[], Any]]] = {}


class _Absent:
    """An availability function that answers False to the module `target` and the real answer to anyone else."""

    def __init__(self, real: Callable[..., bool], target: str) -> None:
        self.real = real
        self.target = target

    def __call__(self, *args: Any, **kwargs: Any) -> bool:
        if sys._getframe(1).f_globals.get("__name__") == self.target:
            return False
        return self.real(*args, **kwargs)


def _run_hidden(name: str, rule: Rule, exec_module: Callable[[Any], None], module: Any) -> None:
    """Runs `exec_module(module)` with `rule.flag` answering "absent" to it, then restores and stands in."""
    flags = importlib.import_module(rule.flags)
    real = getattr(flags, rule.flag)
    if rule.package in sys.modules or not real():
        exec_module(module)
        return
    fake = _Absent(real, name)
    patched = [m for m in (flags, sys.modules.get(rule.flags + ".import_utils"))
               if m is not None and getattr(m, rule.flag, None) is real]
    before = set(sys.modules)
    for m in patched:
        setattr(m, rule.flag, fake)
    try:
        exec_module(module)
    finally:
        for m in patched:
            setattr(m, rule.flag, real)
        for new in (set(sys.modules) - before) | {name}:
            namespace = getattr(sys.modules.get(new), "__dict__", None)
            if namespace is None:
                continue
            for key, value in list(namespace.items()):
                if value is fake:
                    namespace[key] = real
    for key, value in rule.stand_ins(module).items():
        if key not in vars(module):
            setattr(module, key, value)
    if rule.on_import is not None:
        action = rule.on_import(module)
        if action is not None:
            _ON_IMPORT.setdefault(rule.package, []).append(action)


class _Loader(importlib.abc.Loader):
    """The module's own loader, its `exec_module` run through `_run_hidden` (or followed by the on-import actions
    of a watched package); the module keeps the real loader as `__loader__`."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        rule = RULES.get(self._name)
        lazy = {p for p in LAZY.get(self._name, ()) if p not in sys.modules}
        _LAZY_NOW.update(lazy)
        try:
            if rule is None:
                self._loader.exec_module(module)
            else:
                _run_hidden(self._name, rule, self._loader.exec_module, module)
        finally:
            _LAZY_NOW.difference_update(lazy)
        for action in _ON_IMPORT.pop(self._name, ()):
            action()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if os.environ.get(PLAIN_IMPORT_ENV) or not any(fullname in t for t in (RULES, _ON_IMPORT, LAZY, _LAZY_NOW)):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                lazy = fullname in _LAZY_NOW
                spec.loader = importlib.util.LazyLoader(spec.loader) if lazy else _Loader(spec.loader, fullname)
            return spec
        return None


def install() -> bool:
    """Puts the finder first in `sys.meta_path` (idempotent); False under the opt-out."""
    if os.environ.get(PLAIN_IMPORT_ENV):
        return False
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return True

