"""Issue 24: sd-scripts flags that were 'unrecognized arguments' and now act: deprecated FLUX.1 block-swap aliases,
--text_encoder_batch_size, --console_log_*."""

import logging

import pytest

from library.cli.memory import blocks_to_swap_with_aliases
from library.cli.text_cache import text_cache_options_from_args
from library.core.errors import ConfigError


def test_deprecated_block_swap_flags_map_as_sd_scripts(caplog):
    caplog.set_level(logging.WARNING)
    assert blocks_to_swap_with_aliases({"split_mode": True}) == 18  # flux_train_network.py
    assert blocks_to_swap_with_aliases({"split_mode": True, "blocks_to_swap": 6}) == 6
    assert blocks_to_swap_with_aliases({"double_blocks_to_swap": 4, "single_blocks_to_swap": 7}) == 7  # 4 + 7 // 2
    assert blocks_to_swap_with_aliases({"blocks_to_swap": 5}) == 5
    assert sum("deprecated" in r.message for r in caplog.records) == 3
    with pytest.raises(ConfigError, match="^--double_blocks_to_swap / --single_blocks_to_swap: deprecated forms"):
        blocks_to_swap_with_aliases({"double_blocks_to_swap": 4, "blocks_to_swap": 5})


def test_text_encoder_batch_size_sets_the_caching_batch():
    assert text_cache_options_from_args({"cache_text_encoder_outputs": True, "vae_batch_size": 3}).batch_size == 3
    assert text_cache_options_from_args({"cache_text_encoder_outputs": True, "vae_batch_size": 3,
                                         "text_encoder_batch_size": 8}).batch_size == 8


def test_console_log_file_level_and_simple(tmp_path):
    from library.cli.entry import configure_console_logging

    root = logging.getLogger()
    before = (root.level, list(root.handlers), [h.formatter for h in root.handlers])
    path = tmp_path / "run.log"
    try:
        configure_console_logging("WARNING", str(path), True)
        logging.getLogger("x").info("hidden")
        logging.getLogger("x").warning("shown")
    finally:
        for h in root.handlers:
            if h not in before[1]:
                h.close()
        root.handlers[:] = before[1]
        for h, f in zip(before[1], before[2]):
            h.setFormatter(f)
        root.setLevel(before[0])
    assert path.read_text() == "shown\n"
    with pytest.raises(ConfigError, match="^--console_log_file .*: its folder does not exist$"):
        configure_console_logging(None, str(tmp_path / "no" / "run.log"), False)
