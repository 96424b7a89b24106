"""--base_model_precision: resident size, peak host memory and LoRA step time of a quantized FLUX.1 base vs bf16.

Memory: FLUX.1-dev's full-width blocks (hidden 3072, 24 heads; one double and one single block, random weights),
built in bf16 and quantized by library/train/memory/quantize.py as the trainer does. The resident size counts what each
library stores (codes and scales, library/train/memory/quantize.py resident_bytes) and is scaled on paper to the full
depth (19 double + 38 single blocks; the embedders, about 0.5% of the model, left out). Peak host memory is the
child process's peak RSS while building and quantizing, over its bf16 resident size (the trainer quantizes after
the family has loaded the model in the training dtype, layer by layer: the peak is the bf16 model plus one layer).

Step time: a LoRA (rank 16, every Linear of the blocks, weights in bf16) training step on the same transformer
at a narrower width (--step_heads x 128), batch 1, 32x32 latent (256 image tokens) and 64 text tokens, median of
--steps, as a ratio against bf16 measured in the same run. Each value runs in its own process.

Quantize on load (`--load`): a BFL-layout FLUX.1-dev file with `--double` / `--single` full-width blocks (random
weights, bf16) is written once, then each value loads it in its own process as the trainer does (the family's
`load_bfl_transformer` in bf16, then `quantize_frozen`); printed is the process's peak RSS during that, above its
RSS before loading, over the bf16 size of the file's tensors. `no_change` reads every weight once (training
touches them all), the quantized values only quantize. `gguf-Q8_0` / `gguf-Q4_0`: the same file written as a
ComfyUI-GGUF file (library/families/common/gguf_file.py write_gguf, city96's layout) and loaded from it by the
same `load_bfl_transformer` (weights kept quantized, mapped from the file); every GGUF weight is dequantized once,
as the first training step does, so its pages are read.

    python bench/bench_quantized.py [--values int8-quanto nf4-bnb gguf-Q8_0 ...] [--steps 3] [--step_heads 6]
    python bench/bench_quantized.py --load [--double 1 --single 2] [--values ... gguf-Q8_0 gguf-Q4_0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import peak_rss_mib  # noqa: E402
from library.train.memory.quantize import NO_CHANGE, PRECISIONS, precision_unavailable, quantize_frozen, resident_bytes  # noqa: E402,E501

FULL_DOUBLE, FULL_SINGLE = 19, 38


def build(heads: int):
    """FLUX.1-dev's transformer with one double and one single block, `heads` x 128 wide, in bf16."""
    import dataclasses

    from bench.bench_flux_step import build_transformer
    from library.families.flux import configs

    if heads == configs.PRESETS["random:flux-dev"].heads:
        return build_transformer(1, 1, torch.bfloat16)
    preset = dataclasses.replace(configs.PRESETS["random:flux-dev"], heads=heads)
    saved = configs.PRESETS["random:flux-dev"]
    configs.PRESETS["random:flux-dev"] = preset
    try:
        return build_transformer(1, 1, torch.bfloat16)
    finally:
        configs.PRESETS["random:flux-dev"] = saved


def from_gguf(model, value: str):
    """`model` written as a ComfyUI-GGUF file of `value` (gguf-Q8_0 ...) and loaded back as the trainer loads it."""
    import tempfile

    from library.families.common.gguf_file import write_gguf
    from library.families.flux.layout import diffusers_to_bfl
    from library.families.flux.loading import load_bfl_transformer

    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "model.gguf")
        write_gguf(path, {k: v.contiguous() for k, v in diffusers_to_bfl(model.state_dict()).items()},
                   GGUF_VALUES[value][0], "flux")
        return load_bfl_transformer(path, torch.bfloat16).requires_grad_(False)  # mapped: kept after unlinking


def prepared(heads: int, value: str):
    """The step-time / size model for `value`: bf16, quantized by its library, or loaded from a GGUF file."""
    model = build(heads)
    if value in GGUF_VALUES:
        return from_gguf(model, value)
    quantize_frozen(model, value)
    return model


def one(value: str, steps: int, step_heads: int) -> dict:
    model = build(24)
    double, single = model.transformer_blocks[0], model.single_transformer_blocks[0]
    bf16 = {"double": resident_bytes(double), "single": resident_bytes(single)}
    rss_bf16 = peak_rss_mib()
    start = time.perf_counter()
    if value in GGUF_VALUES:
        model = from_gguf(model, value)
        double, single = model.transformer_blocks[0], model.single_transformer_blocks[0]
        count = sum(1 for m in model.modules() if type(m).__name__ == "GgufLinear")
    else:
        count = quantize_frozen(model, value)
    seconds = time.perf_counter() - start
    sizes = {"double": resident_bytes(double), "single": resident_bytes(single)}
    peak = peak_rss_mib()
    del model, double, single
    return {"value": value, "layers": count, "quantize_s": seconds, "bf16": bf16, "sizes": sizes,
            "peak_rss_mib": peak, "rss_after_bf16_build_mib": rss_bf16, "step_s": step_time(value, steps, step_heads)}


def step_time(value: str, steps: int, heads: int) -> float:
    from networks.lora_module import LoRAModule

    torch.manual_seed(0)
    model = prepared(heads, value)
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "transformer_blocks" in n]
    loras = [LoRAModule(f"lora_{i}", m, lora_dim=16, alpha=16).to(torch.bfloat16) for i, (_, m) in enumerate(targets)]
    for lora in loras:
        lora.apply_to()
        torch.nn.init.normal_(lora.lora_up.weight, std=1e-3)
    params = [p for lora in loras for p in lora.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(1, 256, 64, generator=g).to(bf)
    txt = torch.randn(1, 64, 4096, generator=g).to(bf)
    pooled = torch.randn(1, 768, generator=g).to(bf)
    img_ids = torch.zeros(256, 3)
    img_ids[:, 1], img_ids[:, 2] = torch.arange(256) // 16, torch.arange(256) % 16
    txt_ids = torch.zeros(64, 3)
    target = torch.randn(1, 256, 64, generator=g).to(bf)

    def step():
        out = model(hidden_states=x, encoder_hidden_states=txt, pooled_projections=pooled,
                    timestep=torch.tensor([0.5], dtype=bf), img_ids=img_ids, txt_ids=txt_ids,
                    guidance=torch.tensor([1.0], dtype=bf), return_dict=False)[0]
        torch.nn.functional.mse_loss(out.float(), target.float()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def hwm_rss_mib() -> float:
    """This process's RSS high-water mark (VmHWM: unlike ru_maxrss, not carried over from the parent across exec)."""
    with open("/proc/self/status", encoding="utf-8") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 1024


def current_rss_mib() -> float:
    with open("/proc/self/statm", encoding="utf-8") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def write_flux_file(path: str, double: int, single: int) -> int:
    """A BFL FLUX.1-dev transformer file with `double` / `single` full-width blocks (bf16); its tensor bytes."""
    from safetensors.torch import save_file

    from bench.bench_flux_step import build_transformer
    from library.families.flux.layout import diffusers_to_bfl

    torch.manual_seed(0)
    model = build_transformer(double, single, torch.bfloat16)
    tensors = {k: v.contiguous() for k, v in diffusers_to_bfl(model.state_dict()).items()}
    save_file(tensors, path + ".tmp")
    os.replace(path + ".tmp", path)
    return sum(t.numel() * t.element_size() for t in tensors.values())


GGUF_VALUES = {"gguf-Q8_0": ("Q8_0", 8), "gguf-Q4_0": ("Q4_0", 4)}


def gguf_path(path: str, value: str) -> str:
    """The ComfyUI-GGUF copy of the bf16 file for `value` (gguf-Q8_0 ...), written once."""
    qtype = GGUF_VALUES[value][0]
    out = path[:-len(".safetensors")] + f"-{qtype}.gguf"
    if not os.path.isfile(out):
        from safetensors.torch import load_file

        from library.families.common.gguf_file import write_gguf

        write_gguf(out, load_file(path), qtype, "flux")
    return out


def load_one(value: str, path: str) -> dict:
    """Load `path` as the trainer does and quantize it; peak RSS above the RSS before loading."""
    from diffusers import FluxTransformer2DModel  # noqa: F401 - imported (code, not weights) before measuring
    from library.families.flux.loading import load_bfl_transformer

    gguf = value in GGUF_VALUES
    if gguf:
        from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

        from library.families.common.gguf_file import gguf_linear_class, is_quantized

        gguf_linear_class()  # the library's code, not weights, before measuring
        path = gguf_path(path, value)
    else:
        quantize_frozen(torch.nn.Sequential(torch.nn.Linear(256, 256)).requires_grad_(False), value)  # its library
    before = current_rss_mib()
    start = time.perf_counter()
    model = load_bfl_transformer(path, torch.bfloat16).requires_grad_(False)  # frozen, as the trainer has it
    if value == NO_CHANGE:
        total = sum(float(p.float().sum()) for p in model.parameters())  # every weight read once, as training does
        assert total == total
    if gguf:  # every weight dequantized once, as the first forward does (one layer's temporaries at a time)
        total = sum(float(dequantize_gguf_tensor(p).to(torch.bfloat16).sum()) if is_quantized(p)
                    else float(p.float().sum()) for p in model.parameters())
        assert total == total
        count = sum(1 for p in model.parameters() if is_quantized(p))
    else:
        count = quantize_frozen(model, value)
    seconds = time.perf_counter() - start
    doubles, singles = model.transformer_blocks, model.single_transformer_blocks
    resident = resident_bytes(model)
    per_double, per_single = resident_bytes(doubles) / len(doubles), resident_bytes(singles) / len(singles)
    return {"value": value, "layers": count, "load_s": seconds, "resident": resident,
            "per_double": per_double, "per_single": per_single,
            "rest": resident - per_double * len(doubles) - per_single * len(singles),
            "peak_mib": hwm_rss_mib() - before, "rss_after_mib": current_rss_mib() - before}


def main_load(a) -> None:
    path = os.path.join(a.dir, f"flux1-dev-{a.double}d{a.single}s-bf16.safetensors")
    bf16_bytes = write_flux_file(path, a.double, a.single) if not os.path.isfile(path) else None
    if bf16_bytes is None:
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            bf16_bytes = sum(f.get_slice(k).get_shape().numel() if hasattr(f.get_slice(k).get_shape(), "numel")
                             else _numel(f.get_slice(k).get_shape()) for k in f.keys()) * 2
    results = {}
    for value in [NO_CHANGE, *[v for v in a.values if v != NO_CHANGE]]:
        why = None if value in GGUF_VALUES else precision_unavailable(value)
        if why:
            print(f"{value}: skipped ({why})")
            continue
        if value in GGUF_VALUES:
            gguf_path(path, value)  # written here, not in the measured process
        out = subprocess.run([sys.executable, __file__, "--load_one", value, "--file", path],
                             capture_output=True, text=True)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"{value}: failed ({(out.stderr.strip().splitlines() or ['?'])[-1]})")
            continue
        results[value] = json.loads(line[len("RESULT "):])
    mib = bf16_bytes / 2 ** 20
    full = full_flux_bytes()
    print(f"FLUX.1-dev transformer file, {a.double} double + {a.single} single full-width blocks: {mib:.0f} MiB bf16; "
          f"peak RSS while loading (above the RSS before) over that size; 'full depth': the peak scaled to the "
          f"19 + 38 blocks ({full / 2 ** 30:.2f} GiB bf16): each block's resident size times the depth plus the "
          f"embedders' as they are; the rest of the peak (RSS beyond the resident weights, one layer's "
          f"temporaries) does not scale")
    print(f"{'value':<14}{'layers':>7}{'resident/bf16':>15}{'peak load/bf16':>16}{'after/bf16':>12}"
          f"{'full depth':>12}{'after x depth':>15}{'target':>8}{'load s':>8}")
    for value, r in results.items():
        bits = PRECISIONS[value].bits if value in PRECISIONS else GGUF_VALUES.get(value, ("", 16))[1]
        target = {8: "<=0.55", 4: "<=0.35"}.get(bits, "")
        after = r["rss_after_mib"] / mib
        full_resident = FULL_DOUBLE * r["per_double"] + FULL_SINGLE * r["per_single"] + r["rest"]
        scaled = (full_resident + r["peak_mib"] * 2 ** 20 - r["resident"]) / full
        # the earlier, blunter estimate: the whole RSS after loading scaled with the depth (embedders included)
        blunt = (after * full + (r["peak_mib"] - r["rss_after_mib"]) * 2 ** 20) / full
        print(f"{value:<14}{r['layers']:>7}{r['resident'] / bf16_bytes:>15.3f}{r['peak_mib'] / mib:>16.3f}"
              f"{after:>12.3f}{scaled:>12.3f}{blunt:>15.3f}{target:>8}{r['load_s']:>8.1f}")


def full_flux_bytes() -> int:
    """bf16 bytes of the whole FLUX.1-dev transformer (19 + 38 blocks), counted on the meta device."""
    import dataclasses

    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel

    from library.families.flux.configs import PRESETS, transformer_config

    with init_empty_weights():
        model = FluxTransformer2DModel(**transformer_config(dataclasses.replace(
            PRESETS["random:flux-dev"], double_blocks=FULL_DOUBLE, single_blocks=FULL_SINGLE)))
    return sum(p.numel() for p in model.parameters()) * 2


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--values", nargs="*", default=list(PRECISIONS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--step_heads", type=int, default=6, help="width of the step-time model, in 128-wide heads")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--load", action="store_true", help="measure quantize on load from a FLUX.1 file instead")
    p.add_argument("--double", type=int, default=1, help="--load: full-width double blocks in the file")
    p.add_argument("--single", type=int, default=2, help="--load: full-width single blocks in the file")
    p.add_argument("--dir", default="/tmp", help="--load: where the FLUX.1 file is written (kept for reruns)")
    p.add_argument("--load_one", help=argparse.SUPPRESS)
    p.add_argument("--file", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.load_one:
        print("RESULT " + json.dumps(load_one(a.load_one, a.file)))
        return
    if a.load:
        main_load(a)
        return
    if a.one:
        print("RESULT " + json.dumps(one(a.one, a.steps, a.step_heads)))
        return
    results = {}
    for value in [NO_CHANGE, *[v for v in a.values if v != NO_CHANGE]]:
        why = None if value in GGUF_VALUES else precision_unavailable(value)
        if why:
            print(f"{value}: skipped ({why})")
            continue
        out = subprocess.run([sys.executable, __file__, "--one", value, "--steps", str(a.steps),
                              "--step_heads", str(a.step_heads)], capture_output=True, text=True)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"{value}: failed ({(out.stderr.strip().splitlines() or ['?'])[-1]})")
            continue
        results[value] = json.loads(line[len("RESULT "):])
    base = results[NO_CHANGE]

    def full(r):  # bytes of the 19 + 38 blocks
        return FULL_DOUBLE * r["sizes"]["double"] + FULL_SINGLE * r["sizes"]["single"]

    gib = 2 ** 30
    print(f"FLUX.1-dev blocks (19 double + 38 single) in bf16: {full(base) / gib:.2f} GiB; "
          f"step-time model {a.step_heads * 128} wide, {torch.get_num_threads()} thread(s)")
    print(f"{'value':<14}{'resident':>10}{'x bf16':>8}{'target':>8}{'peak RSS / bf16':>17}{'quantize s':>12}"
          f"{'step s':>8}{'x bf16':>8}")
    bf16_block = base["bf16"]["double"] + base["bf16"]["single"]
    for value, r in results.items():
        ratio = full(r) / full(base)
        bits = PRECISIONS[value].bits if value in PRECISIONS else GGUF_VALUES.get(value, ("", 16))[1]
        target = {8: "<=0.55", 4: "<=0.35"}.get(bits, "")
        peak = r["peak_rss_mib"] * 2 ** 20 / bf16_block
        print(f"{value:<14}{full(r) / gib:>8.2f}Gi{ratio:>8.3f}{target:>8}{peak:>17.2f}{r['quantize_s']:>12.1f}"
              f"{r['step_s']:>8.2f}{r['step_s'] / base['step_s']:>8.2f}")


if __name__ == "__main__":
    main()
