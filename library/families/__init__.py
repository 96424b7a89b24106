"""Model families by name: the only place that maps a name to a family class."""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Optional

from library.core.errors import ConfigError
from library.families.base import ModelFamily
from library.families.common import deferred_backends

# Before any family imports a transformers or diffusers model: torchao and scipy are imported on first use only.
deferred_backends.install()


class _NoEmptyFp32Warning(logging.Filter):
    """diffusers warns on every `.to(dtype)` of a model whose list of float32-only modules is empty
    (FluxTransformer2DModel: "... should be kept in float32: []"); there is nothing to keep, so drop it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "should be kept in float32: []" not in record.getMessage()


logging.getLogger("diffusers.models.modeling_utils").addFilter(_NoEmptyFp32Warning())


def _sd() -> ModelFamily:
    from library.families.sd.family import SDFamily

    return SDFamily()


def _sdxl() -> ModelFamily:
    from library.families.sdxl.family import SDXLFamily

    return SDXLFamily()


def _flux() -> ModelFamily:
    from library.families.flux.family import FluxFamily

    return FluxFamily()


def _chroma() -> ModelFamily:
    from library.families.chroma.family import ChromaFamily

    return ChromaFamily()


def _anima() -> ModelFamily:
    from library.families.anima.family import AnimaFamily

    return AnimaFamily()


def _sd3() -> ModelFamily:
    from library.families.sd3.family import SD3Family

    return SD3Family()


def _lumina() -> ModelFamily:
    from library.families.lumina.family import LuminaFamily

    return LuminaFamily()


def _hunyuan_image() -> ModelFamily:
    from library.families.hunyuan_image.family import HunyuanImageFamily

    return HunyuanImageFamily()


def _flux2() -> ModelFamily:
    from library.families.flux2.family import Flux2Family

    return Flux2Family()


def _zimage() -> ModelFamily:
    from library.families.zimage.family import ZImageFamily

    return ZImageFamily()


def _qwen_image() -> ModelFamily:
    from library.families.qwen_image.family import QwenImageFamily

    return QwenImageFamily()


# Factories import lazily so that asking for one family does not import the others.
_REGISTRY: dict[str, Callable[[], ModelFamily]] = {"sd": _sd, "sdxl": _sdxl, "flux": _flux, "chroma": _chroma,
                                                   "anima": _anima, "sd3": _sd3,
                                                   "lumina": _lumina, "hunyuan_image": _hunyuan_image,
                                                   "zimage": _zimage, "qwen_image": _qwen_image, "flux2": _flux2}


# The family of a model path that tells nothing else and of a tool given no selector (sd-scripts' default: SD 1.x/2.x).
DEFAULT_FAMILY = "sd"


def family_names() -> list[str]:
    """Names accepted by `get_family`, sorted."""
    return sorted(_REGISTRY)


def get_family(name: str) -> ModelFamily:
    """A new instance of the family called `name` ("sd" for SD 1.x and 2.x)."""
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ConfigError(f"model family: expected one of {', '.join(family_names())}, got {name!r}")
    return factory()


def registered_families() -> list[ModelFamily]:
    """One instance of every registered family, in registration order (imports them all)."""
    return [factory() for factory in _REGISTRY.values()]


def selected_family(values: Mapping[str, Any]) -> Optional[str]:
    """The family whose sd-scripts selector flag (`--sdxl`, `--flux`: `ModelFamily.selector_flag`) is set in
    `values` (parsed flag values by name), or None."""
    for family in registered_families():
        if family.selector_flag and values.get(family.selector_flag):
            return family.name
    return None


def selector_flags() -> dict[str, str]:
    """The sd-scripts selector flags of the shared tools ("--sdxl") and the family each selects."""
    return {f"--{family.selector_flag}": family.name for family in registered_families() if family.selector_flag}
