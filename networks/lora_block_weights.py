"""LoRA Block Weight lists (`--lbws`): one weight per UNet block, as the sd-webui "LoRA Block Weight" extension.

A list's length says which standard it follows (BASE weights the text encoders):

- 26, SD 1.x/2.x, every block: BASE, IN00-IN11, M00, OUT00-OUT11
- 17, SD 1.x/2.x, the blocks that hold attention: BASE, IN01, IN02, IN04, IN05, IN07, IN08, M00, OUT03-OUT11
- 20, SDXL, every block: BASE, IN00-IN08, M00, OUT00-OUT08
- 12, SDXL, the blocks that hold attention: BASE, IN04, IN05, IN07, IN08, M00, OUT00-OUT05

A module's block comes from its kohya name through the block layout networks.lora
already uses for block_dims (SD_BLOCK_LAYOUT, SDXL's sdxl_block_layout). Blocks a
short list leaves out keep weight 1. FLUX.1 has no such standard.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from library.core.errors import ConfigError
from networks.lora_args import SD_BLOCK_LAYOUT, BlockLayout, sdxl_block_layout

TEXT_ENCODER_PREFIX = "lora_te"  # lora_te_, lora_te1_, lora_te2_, lora_te3_: the BASE block
UNET_PREFIX = "lora_unet_"


def _blocks(prefix: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i:02d}" for i in range(n))


@dataclass(frozen=True)
class BlockWeightStandard:
    """One list length: the blocks it names, in order, and where each module of its model falls."""

    model: str  # for messages: "SD 1.x/2.x", "SDXL"
    blocks: tuple[str, ...]  # "BASE" first
    layout: BlockLayout
    layout_blocks: tuple[str, ...]  # the block name of each layout index

    def block_of(self, lora_name: str) -> Optional[str]:
        """The block of a kohya module name ("BASE" for the text encoders), None for a module in no block."""
        if lora_name.startswith(TEXT_ENCODER_PREFIX):
            return "BASE"
        index = self.layout(lora_name)
        return self.layout_blocks[index] if index >= 0 else None


# The layouts' block indices as block names. SD: IN00-IN11, MID, OUT00-OUT11 (25). SDXL (23): the time and
# label embeddings sit with IN00 (as in sd-scripts), the three parts of the middle block are M00, and the
# final `out` layers go with the last block, OUT08.
SD_LAYOUT_BLOCKS = _blocks("IN", 12) + ("M00",) + _blocks("OUT", 12)
SDXL_LAYOUT_BLOCKS = ("IN00",) + _blocks("IN", 9) + ("M00",) * 3 + _blocks("OUT", 9) + ("OUT08",)


@functools.lru_cache(maxsize=1)
def standards() -> dict[int, BlockWeightStandard]:
    """The four list lengths the extension (and sd-scripts' svd_merge_lora) accept."""
    sdxl = sdxl_block_layout()
    return {
        26: BlockWeightStandard("SD 1.x/2.x", ("BASE",) + SD_LAYOUT_BLOCKS, SD_BLOCK_LAYOUT, SD_LAYOUT_BLOCKS),
        17: BlockWeightStandard("SD 1.x/2.x", ("BASE", "IN01", "IN02", "IN04", "IN05", "IN07", "IN08", "M00")
                                + _blocks("OUT", 12)[3:], SD_BLOCK_LAYOUT, SD_LAYOUT_BLOCKS),
        20: BlockWeightStandard("SDXL", ("BASE",) + _blocks("IN", 9) + ("M00",) + _blocks("OUT", 9), sdxl,
                                SDXL_LAYOUT_BLOCKS),
        12: BlockWeightStandard("SDXL", ("BASE", "IN04", "IN05", "IN07", "IN08", "M00") + _blocks("OUT", 6), sdxl,
                                SDXL_LAYOUT_BLOCKS),
    }


EXPECTED = "17 or 26 values for SD 1.x/2.x, 12 or 20 for SDXL (FLUX.1 has no block-weight standard)"


def parse_lbw(text: str, flag: str = "--lbws") -> list[float]:
    """"1,0,0.5" or sd-scripts' JSON form "[1,0,0.5]" -> [1.0, 0.0, 0.5], of a length some standard has."""
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    try:
        weights = [float(part) for part in body.split(",")]
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated numbers like 1,0,0.5, got {text!r}") from None
    if len(weights) not in standards():
        raise ConfigError(f"{flag}: expected {EXPECTED}, got {len(weights)} in {text!r}")
    return weights


def module_block_weights(weights: Sequence[float], module_names: Iterable[str], source: str,
                         flag: str = "--lbws") -> dict[str, float]:
    """The weight of every module of one LoRA file under a block-weight list.

    Refuses a list whose standard is for another model: the file's UNet modules must
    fall in that model's blocks. Modules in no block (SD's conv_in/conv_out/time
    embedding, which only LyCORIS' `full` preset trains) keep weight 1.
    """
    standard = standards().get(len(weights))
    if standard is None:
        raise ConfigError(f"{flag}: expected {EXPECTED}, got {len(weights)}")
    by_block = dict(zip(standard.blocks, weights))
    names = list(module_names)
    unet = [n for n in names if n.startswith(UNET_PREFIX)]
    if unet and all(standard.layout(n) < 0 for n in unet):
        raise ConfigError(f"{flag}: {len(weights)} values are for {standard.model} LoRAs, but the UNet modules of "
                          f"{source} (e.g. {unet[0]}) are not in its blocks; expected {EXPECTED}")
    return {name: by_block.get(standard.block_of(name), 1.0) for name in names}


def check_lbws(lbws: Optional[Sequence[str]], models: Sequence[str]) -> list[Optional[list[float]]]:
    """--lbws: none, or one list per --models file (parsed); [None] * len(models) when not given."""
    if not lbws:
        return [None] * len(models)
    if len(lbws) != len(models):
        raise ConfigError(f"--lbws: expected one list per --models file ({len(models)}), got {len(lbws)}")
    return [parse_lbw(text, f"--lbws[{i}]") for i, text in enumerate(lbws)]
