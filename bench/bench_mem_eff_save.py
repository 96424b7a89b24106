"""Peak memory of saving a whole model with and without --mem_eff_save, measured in the same run.

Each mode runs in its own child process (same model, same seed): it builds the model, resets the
process's peak-RSS mark (/proc/self/clear_refs), calls `family.save_model(..., "safetensors", dtype,
mem_eff=...)` and reports the new peak (VmHWM) and the RSS before saving. The parent prints both, the
ratio of the peaks and of the memory the save added on top of the model, the file sizes and times, and
checks that both files hold the same tensors (names, dtypes, bytes).

Default model: `random:sd15`, the full-size SD 1.5 architecture (UNet, VAE, CLIP-L; 1.07 B parameters,
4.3 GB in float32) with random weights, saved as fp16 (--save_precision fp16) in the LDM single-file
layout. `--preset tiny:sdxl` etc. work too; `random:sd21` is SD 2.1 768-v.

    python bench/bench_mem_eff_save.py [--preset random:sd15] [--family sd] [--dtype fp16|bf16|float]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "float": None}


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(args) -> None:
    from library.families import get_family
    from library.families.base import LoadOptions

    torch.set_num_threads(1)
    family = get_family(args.family)
    components = family.load(LoadOptions(args.preset))
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    family.save_model(components, args.out, "safetensors", DTYPES[args.dtype], {"modelspec.title": "bench"},
                      mem_eff=args.mode == "mem_eff")
    seconds = time.perf_counter() - start
    print(json.dumps({"before_mib": before / 1024, "peak_mib": _status_kib("VmHWM") / 1024, "seconds": seconds}))


def same_tensors(a: str, b: str) -> bool:
    from safetensors import safe_open

    with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
        if set(fa.keys()) != set(fb.keys()) or fa.metadata() != fb.metadata():
            return False
        for key in fa.keys():
            x, y = fa.get_tensor(key), fb.get_tensor(key)
            if x.dtype != y.dtype or not torch.equal(x, y):
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="random:sd15")
    parser.add_argument("--family", default="sd")
    parser.add_argument("--dtype", default="fp16", choices=list(DTYPES))
    parser.add_argument("--mode", choices=["normal", "mem_eff"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        child(args)
        return
    with tempfile.TemporaryDirectory(prefix="bench-mem-eff-save-") as tmp:
        results, paths = {}, {}
        for mode in ("normal", "mem_eff"):
            paths[mode] = os.path.join(tmp, f"{mode}.safetensors")
            out = subprocess.run([sys.executable, __file__, "--preset", args.preset, "--family", args.family,
                                  "--dtype", args.dtype, "--mode", mode, "--out", paths[mode]],
                                 check=True, capture_output=True, text=True).stdout
            results[mode] = json.loads(out.strip().splitlines()[-1])
        same = same_tensors(paths["normal"], paths["mem_eff"])
        size = os.path.getsize(paths["normal"]) / 2**20
    print(f"{args.preset} ({args.family}) saved as safetensors, dtype {args.dtype}; file {size:.0f} MiB")
    for mode, r in results.items():
        print(f"  {mode:8s} RSS before {r['before_mib']:8.0f} MiB  peak {r['peak_mib']:8.0f} MiB  "
              f"added {r['peak_mib'] - r['before_mib']:8.0f} MiB  {r['seconds']:6.1f} s")
    n, m = results["normal"], results["mem_eff"]
    added_n, added_m = n["peak_mib"] - n["before_mib"], m["peak_mib"] - m["before_mib"]
    print(f"  peak ratio normal / mem_eff: {n['peak_mib'] / m['peak_mib']:.2f}; "
          f"added-memory ratio: {added_n / max(added_m, 1.0):.1f}")
    print(f"  same tensors in both files: {same}")


if __name__ == "__main__":
    main()
