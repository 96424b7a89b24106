"""Model families by name: the only place that maps a name to a family class."""

from __future__ import annotations

import logging
from typing import Callable

from library.core.errors import ConfigError
from library.families.base import ModelFamily


class _NoEmptyFp32Warning(logging.Filter):
    """diffusers warns on every `.to(dtype)` of a model whose list of float32-only modules is empty
    (FluxTransformer2DModel: "... should be kept in float32: []"); there is nothing to keep, so drop it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "should be kept in float32: []" not in record.getMessage()


logging.getLogger("diffusers.models.modeling_utils").addFilter(_NoEmptyFp32Warning())


def _sd() -> ModelFamily:
    from library.families.sd import SDFamily

    return SDFamily()


def _sdxl() -> ModelFamily:
    from library.families.sdxl import SDXLFamily

    return SDXLFamily()


def _flux() -> ModelFamily:
    from library.families.flux import FluxFamily

    return FluxFamily()


def _chroma() -> ModelFamily:
    from library.families.chroma import ChromaFamily

    return ChromaFamily()


def _anima() -> ModelFamily:
    from library.families.anima import AnimaFamily

    return AnimaFamily()


def _sd3() -> ModelFamily:
    from library.families.sd3 import SD3Family

    return SD3Family()


def _lumina() -> ModelFamily:
    from library.families.lumina import LuminaFamily

    return LuminaFamily()


def _hunyuan_image() -> ModelFamily:
    from library.families.hunyuan_image import HunyuanImageFamily

    return HunyuanImageFamily()


# Factories import lazily so that asking for one family does not import the others.
_REGISTRY: dict[str, Callable[[], ModelFamily]] = {"sd": _sd, "sdxl": _sdxl, "flux": _flux, "chroma": _chroma,
                                                   "anima": _anima, "sd3": _sd3,
                                                   "lumina": _lumina, "hunyuan_image": _hunyuan_image}


def family_names() -> list[str]:
    """Names accepted by `get_family`, sorted."""
    return sorted(_REGISTRY)


def get_family(name: str) -> ModelFamily:
    """A new instance of the family called `name` ("sd" for SD 1.x and 2.x)."""
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ConfigError(f"model family: expected one of {', '.join(family_names())}, got {name!r}")
    return factory()
