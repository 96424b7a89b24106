"""Load our SD 1.5 network files with sd-scripts' own network modules, on sd-scripts' own SD 1.5 U-Net.

    python bench/check_sd_scripts_loaders.py --sd_scripts /path/to/sd-scripts \
        lora=out/lora.safetensors dylora=out/dylora.safetensors lora_fa=out/lora_fa.safetensors oft=out/oft.safetensors

Each file must be trained on the SD 1.5 architecture (e.g. `train_network.py --pretrained_model_name_or_path
random:sd15 --network_module networks.<name> --max_train_steps 1 ...`). For each, in this process: sd-scripts'
`networks.<name>.create_network_from_weights`, `apply_to` on its `library.original_unet` U-Net (SD 1.5 config, meta
device) and a CLIP-L text encoder, then the key sets and shapes of its network against the file. Prints one line per
file; exit 1 when any key is missing, unexpected or of another shape. Not part of the test suite: it needs a
checkout of sd-scripts (its `library` package shadows ours, so nothing of this project is imported here).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import types


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sd_scripts", required=True, help="a checkout of kohya-ss/sd-scripts")
    p.add_argument("files", nargs="+", help="NAME=PATH: sd-scripts' network module name and our file")
    args = p.parse_args(argv)
    pairs = [f.split("=", 1) for f in args.files]
    for pair in pairs:
        if len(pair) != 2 or not os.path.isfile(pair[1]):
            p.error(f"{'='.join(pair)}: expected NAME=PATH of an existing file")
    import diffusers  # noqa: F401  (imported before the stub below: it looks torchvision up by its spec)
    import torch
    from safetensors.torch import load_file
    from transformers import CLIPTextConfig, CLIPTextModel

    sys.path.insert(0, os.path.abspath(args.sd_scripts))
    sys.modules.pop("library", None)
    stub = types.ModuleType("torchvision")  # sd-scripts' library.utils imports it; the network modules do not use it
    stub.transforms = types.ModuleType("torchvision.transforms")
    sys.modules.setdefault("torchvision", stub)
    sys.modules.setdefault("torchvision.transforms", stub.transforms)
    from library.original_unet import UNet2DConditionModel  # sd-scripts' own

    with torch.device("meta"):
        unet = UNet2DConditionModel(sample_size=64, attention_head_dim=8, cross_attention_dim=768)
        te = CLIPTextModel(CLIPTextConfig(vocab_size=49408, hidden_size=768, intermediate_size=3072,
                                          num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=77,
                                          hidden_act="quick_gelu"))
    if not any(n.startswith("text_model.") for n, _ in te.named_modules()):
        # transformers 5 dropped the `text_model.` level sd-scripts' pinned transformers 4.x has (its file names)
        class TextModel4(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.text_model = inner
        te = TextModel4(te)
    failed = False
    for name, path in pairs:
        module = importlib.import_module(f"networks.{name}")
        sd = load_file(path)
        made = module.create_network_from_weights(1.0, path, None, te, unet, weights_sd=sd, for_inference=True)
        net = made[0] if isinstance(made, tuple) else made
        net.apply_to(te, unet, True, True)
        theirs = net.state_dict()
        missing, unexpected = sorted(set(theirs) - set(sd)), sorted(set(sd) - set(theirs))
        shapes = sorted(k for k in set(theirs) & set(sd) if theirs[k].shape != sd[k].shape)
        failed |= bool(missing or unexpected or shapes)
        print(f"{name}: {os.path.basename(path)}: {len(sd)} keys; sd-scripts' network {len(theirs)} keys; missing "
              f"{len(missing)}, unexpected {len(unexpected)}, other shape {len(shapes)}"
              + (f" (first: {(missing + unexpected + shapes)[0]})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
