"""diffusers model classes imported from their own module file, without every sibling model (issue 28).

`from diffusers import AutoencoderKL` runs `diffusers.models.autoencoders`' package `__init__`, which imports every
autoencoder diffusers has; a U-Net's blocks import `diffusers.models.transformers`, whose `__init__` imports every
transformer (FLUX.1's, Wan's, ...). diffusers' top-level package and `diffusers.models` are lazy; these
subpackages are not. `diffusers_class(name)` first registers each eager subpackage of `diffusers.models` as a
package whose `__init__` has not run yet (`_DeferredPackage`), then imports the one module file that defines the
class. The first time anything asks such a package for a name it lacks (`diffusers.models.unets.UNet2DModel`,
`from diffusers.models.transformers import X`), the real `__init__` runs in it, so every name diffusers exports is
still there, only later: the modules already imported are reused.

The first such import also keeps peft and bitsandbytes out, which diffusers imports only to bind names that
matter once a model holds their layers (`peft_deferred`): while it runs, diffusers' availability flags for the two
say "absent", so three of its modules skip binding them at import, and then get exact stand-ins:
`diffusers.loaders.lora_base.BaseTunerLayer` and `diffusers.hooks.layerwise_casting.BaseTunerLayer` are a class
that `isinstance` answers as peft's own once `peft.tuners.tuners_utils` is imported (before that, no peft layer can
exist), `layerwise_casting.disable_input_dtype_casting` imports peft's on call, and
`diffusers.quantizers.bitsandbytes.utils.bnb` imports bitsandbytes on first attribute. Each model forward that
diffusers wraps in `apply_lora_scale` calls `scale_lora_layers` / `unscale_lora_layers`, which import peft before
they look at the scale; they are wrapped to return at once while peft's tuners module is not imported (no layer
to scale can exist then; with the scale at 1.0 they do nothing anyway), and call diffusers' own otherwise.
diffusers' pipelines that load a LoRA through peft (`load_lora_weights`) import peft themselves and work as before
(tests/test_family_sdxl.py, tests/test_flux2.py; the stand-ins: tests/test_startup.py).

Where diffusers' lazy tables do not name the class (another diffusers version), it falls back to
`getattr(diffusers, name)`, the ordinary import; `LORA_TOOLKIT_PLAIN_DIFFUSERS_IMPORT=1` in the environment does the
same for every class (the opt-out, should a diffusers release break the deferral), and also turns off
deferred_backends.py, which keeps torchao and scipy out of transformers' and diffusers' import the same way.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import types
from typing import Any, Iterator

from library.families.common.deferred_backends import PLAIN_IMPORT_ENV, ModuleOnUse, NameOnUse, install

# diffusers.models' subpackages whose __init__ imports all of their models (checked against diffusers 0.42).
EAGER_PACKAGES = ("autoencoders", "unets", "transformers", "controlnets", "condition_embedders", "latent_upscaler")


class _DeferredPackage(types.ModuleType):
    """A package registered with its search path whose `__init__` runs on the first name asked of it that it lacks."""

    def __getattr__(self, name: str) -> Any:
        if not vars(self).pop("_deferred", False) or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        self.__spec__.loader.exec_module(self)  # the package's own __init__, in this module: submodules set are kept
        return getattr(self, name)


def is_deferred(package: str) -> bool:
    """Whether `package` is registered and its `__init__` has not run yet."""
    module = sys.modules.get(package)
    return isinstance(module, _DeferredPackage) and vars(module).get("_deferred", False)


def _defer(package: str) -> None:
    if package in sys.modules:
        return
    spec = importlib.util.find_spec(package)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return
    module = importlib.util.module_from_spec(spec)  # __spec__, __path__, __file__, ... as the import system sets them
    module.__class__ = _DeferredPackage
    vars(module)["_deferred"] = True
    sys.modules[package] = module


def defer_eager_packages() -> None:
    """Registers diffusers.models' eager subpackages without running their `__init__` (idempotent)."""
    import diffusers.models  # noqa: F401  (lazy: its __init__ imports no model)

    for sub in EAGER_PACKAGES:
        _defer(f"diffusers.models.{sub}")


# Stands in for peft's BaseTunerLayer in diffusers modules imported without peft: `isinstance` answers as peft's
# class once peft's tuners module is imported, and False before (no peft layer can exist yet).
PeftBaseTunerLayer = NameOnUse("peft.tuners.tuners_utils", "BaseTunerLayer")


def _peft_disable_input_dtype_casting(*args: Any, **kwargs: Any) -> Any:
    from peft.helpers import disable_input_dtype_casting

    return disable_input_dtype_casting(*args, **kwargs)


def _skip_without_peft(fn: Any) -> Any:
    def wrapped(model: Any, weight: Any = None) -> Any:
        if "peft.tuners.tuners_utils" not in sys.modules:
            return None
        return fn(model, weight)

    wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = fn.__doc__
    return wrapped


def _guard_lora_scaling() -> None:
    """diffusers.utils.peft_utils' apply_lora_scale wrapper looks these two up in its module at each forward."""
    peft_utils = sys.modules.get("diffusers.utils.peft_utils")
    if peft_utils is None:
        return
    for name in ("scale_lora_layers", "unscale_lora_layers"):
        fn = getattr(peft_utils, name, None)
        if fn is not None and not hasattr(fn, "__wrapped__"):
            setattr(peft_utils, name, _skip_without_peft(fn))


# (diffusers' availability flag, the package it names, the diffusers modules that bind it at import)
_HIDDEN = (("_peft_available", "peft", ("diffusers.hooks.layerwise_casting", "diffusers.loaders.lora_base")),
           ("_bitsandbytes_available", "bitsandbytes", ("diffusers.quantizers.bitsandbytes.utils",)))


@contextlib.contextmanager
def peft_deferred() -> Iterator[None]:
    """Imports under it bind neither peft nor bitsandbytes in diffusers (see the module docstring); a no-op for a
    package already imported or absent, or a module already imported."""
    import diffusers.utils.import_utils as flags

    hidden = [(flag, pkg, mods) for flag, pkg, mods in _HIDDEN
              if getattr(flags, flag, False) is True and pkg not in sys.modules
              and not any(m in sys.modules for m in mods)]
    for flag, _, _ in hidden:
        setattr(flags, flag, False)
    try:
        yield
    finally:
        if "peft" not in sys.modules:
            _guard_lora_scaling()
        for flag, _, _ in hidden:
            setattr(flags, flag, True)
        for _, pkg, mods in hidden:
            for name in mods:
                module = sys.modules.get(name)
                if module is None:
                    continue
                if pkg == "peft":
                    module.BaseTunerLayer = PeftBaseTunerLayer
                    if hasattr(module, "_SHOULD_DISABLE_PEFT_INPUT_AUTOCAST"):
                        module._SHOULD_DISABLE_PEFT_INPUT_AUTOCAST = True
                        module.disable_input_dtype_casting = _peft_disable_input_dtype_casting
                else:
                    module.bnb = ModuleOnUse(pkg)  # bitsandbytes, imported on its first attribute


def diffusers_module_of(name: str) -> str | None:
    """The module file of diffusers.models that defines `name` ("diffusers.models.unets.unet_2d_condition"),
    from diffusers' own lazy import tables; None where they do not name it as a model."""
    import diffusers

    if getattr(diffusers, "_class_to_module", {}).get(name) != "models":
        return None
    import diffusers.models as models

    sub = getattr(models, "_class_to_module", {}).get(name)
    if not sub or "." not in sub or sub.split(".", 1)[0] not in EAGER_PACKAGES:
        return None
    return f"diffusers.models.{sub}"


def diffusers_class(name: str) -> Any:
    """A diffusers class by its exported name (`diffusers_class("AutoencoderKL")`), importing a model from its own
    module file only; anything else (schedulers, pipelines) by the ordinary `getattr(diffusers, name)`."""
    module_name = None if os.environ.get(PLAIN_IMPORT_ENV) else diffusers_module_of(name)
    if module_name is None:
        import diffusers

        return getattr(diffusers, name)
    install()  # torchao / scipy (already done when library.families was imported)
    defer_eager_packages()
    with peft_deferred():
        module = importlib.import_module(module_name)
    return getattr(module, name)


def diffusers_classes(*names: str) -> tuple[Any, ...]:
    """`diffusers_class` of each name, in order (`AutoencoderKL, UNet = diffusers_classes("AutoencoderKL", ...)`)."""
    return tuple(diffusers_class(n) for n in names)
