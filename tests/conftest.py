"""Test-wide settings: offline, and one intra-op thread.

Multi-threaded CPU kernels (attention, convolution backward) may sum in a different order
from run to run, which changes the last bits of a result; with one thread every run is
bitwise repeatable, which the resume tests rely on. Tiny models lose nothing by it.
"""

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("LORA_TOOLKIT_CACHE_DIR", tempfile.mkdtemp(prefix="lora-toolkit-test-cache-"))

import torch  # noqa: E402

torch.set_num_threads(1)
