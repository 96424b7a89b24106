"""Resize and extract speed: the fast SVDs of networks/ against a straightforward full-SVD implementation, same run.

    python bench/bench_lora_tools.py                 # every 10th of the 722 SDXL UNet modules (2-core friendly)
    python bench/bench_lora_tools.py --every 1       # all 722 modules

Resize: an SDXL-shaped rank-128 LoRA (the in/out dims of the 722 UNet modules of
kohya's SDXL LoRA, random factors) resized to --new_rank by the factor SVD vs a
dense SVD of up @ down per module (what sd-scripts does). Extract: per-layer
difference matrices of those shapes (a rank-64 "fine-tune" plus noise), rank
--dim by randomized SVD vs full SVD. Prints the speed ratios and the errors.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from networks.lora_extract import top_svd  # noqa: E402
from networks.lora_files import LoraModule  # noqa: E402
from networks.lora_resize import ResizeOptions, resize_modules  # noqa: E402
from networks.lora_svd import full_svd  # noqa: E402

CONTEXT_DIM = 2048  # SDXL cross-attention input (both text encoders' states)


def sdxl_unet_shapes() -> list[tuple[str, int, int]]:
    """(name, out, in) of the 722 Linear modules kohya's SDXL LoRA trains in the UNet."""
    # (diffusers block, channels, attentions, transformer depth)
    stages = [("down_blocks_1", 640, 2, 2), ("down_blocks_2", 1280, 2, 10), ("mid_block", 1280, 1, 10),
              ("up_blocks_0", 1280, 3, 10), ("up_blocks_1", 640, 3, 2)]
    shapes = []
    for block, c, n_attn, depth in stages:
        for a in range(n_attn):
            head = f"lora_unet_{block}_attentions_{a}"
            shapes += [(f"{head}_proj_in", c, c), (f"{head}_proj_out", c, c)]
            for t in range(depth):
                tb = f"{head}_transformer_blocks_{t}"
                for attn, kv_in in (("attn1", c), ("attn2", CONTEXT_DIM)):
                    shapes += [(f"{tb}_{attn}_to_q", c, c), (f"{tb}_{attn}_to_k", c, kv_in),
                               (f"{tb}_{attn}_to_v", c, kv_in), (f"{tb}_{attn}_to_out_0", c, c)]
                shapes += [(f"{tb}_ff_net_0_proj", 8 * c, c), (f"{tb}_ff_net_2", c, 4 * c)]
    assert len(shapes) == 722, len(shapes)
    return shapes


def make_lora(shapes, rank: int) -> dict[str, LoraModule]:
    """Random factors with a decaying spectrum, as trained LoRAs have.

    (With i.i.d. factors the singular values crowd together, the rank-k truncation
    is ill-posed, and any two float32 SVDs disagree by ~1e-4 whatever the method.)
    """
    g = torch.Generator().manual_seed(0)
    decay = torch.logspace(0, -2, rank)
    return {n: LoraModule(n, torch.randn(rank, i, generator=g) / i ** 0.5,
                          torch.randn(o, rank, generator=g) * decay * 0.01, float(rank) / 2) for n, o, i in shapes}


def timed(fn, repeats: int = 1):
    """(result, best wall time of `repeats` runs): the machine is shared, the minimum is the least disturbed."""
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return out, best


def bench_resize(shapes, rank: int, new_rank: int) -> None:
    lora = make_lora(shapes, rank)
    opts = ResizeOptions(new_rank=new_rank)
    first = dict(list(lora.items())[:1])
    resize_modules(first, opts), resize_modules(first, ResizeOptions(new_rank=new_rank, svd="full"))  # warm-up
    fast, t_fast = timed(lambda: resize_modules(lora, opts), repeats=3)
    full, t_full = timed(lambda: resize_modules(lora, ResizeOptions(new_rank=new_rank, svd="full")), repeats=2)
    worst = 0.0
    for a, b in zip(fast.modules, full.modules):
        da, db = a.delta(), b.delta()
        worst = max(worst, float((da - db).norm() / db.norm()))
    print(f"resize  {len(shapes)} modules rank {rank} -> {new_rank}: fast {t_fast:.2f} s, full SVD {t_full:.2f} s, "
          f"speed-up {t_full / t_fast:.1f}x, max relative ΔW difference {worst:.2e}")


def bench_extract(shapes, dim: int) -> None:
    g = torch.Generator().manual_seed(1)
    diffs = []
    for _, o, i in shapes:
        signal = (torch.randn(o, 64, generator=g) * torch.logspace(0, -2, 64)) @ torch.randn(64, i, generator=g)
        diffs.append(signal / i ** 0.5 + 1e-3 * torch.randn(o, i, generator=g))
    top_svd(diffs[0], dim, "randomized"), full_svd(diffs[0])  # warm-up
    rand, t_rand = timed(lambda: [top_svd(d, dim, "randomized") for d in diffs], repeats=3)
    full, t_full = timed(lambda: [full_svd(d).truncate(dim) for d in diffs], repeats=2)
    worst = 0.0
    for d, a, b in zip(diffs, rand, full):
        err_rand = float((d - a.matrix()).norm())
        err_full = float((d - b.matrix()).norm())
        worst = max(worst, err_rand / err_full - 1)
    print(f"extract {len(shapes)} layers rank {dim}: randomized {t_rand:.2f} s, full SVD {t_full:.2f} s, "
          f"speed-up {t_full / t_rand:.1f}x, worst residual vs optimal +{worst:.2%}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--every", type=int, default=10, help="take every Nth of the 722 modules (1: all)")
    p.add_argument("--rank", type=int, default=128)
    p.add_argument("--new_rank", type=int, default=32)
    p.add_argument("--dim", type=int, default=32, help="extract rank")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = sdxl_unet_shapes()[::args.every]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {len(shapes)} of 722 SDXL UNet modules")
    bench_resize(shapes, args.rank, args.new_rank)
    bench_extract(shapes, args.dim)


if __name__ == "__main__":
    main()
