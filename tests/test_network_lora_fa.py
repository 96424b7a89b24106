"""--network_module networks.lora_fa: LoRA-FA trains lora_up only and writes networks.lora's file layout."""

from __future__ import annotations

import torch
from safetensors import safe_open

from tests.train_helpers import base_args, make_dataset, make_trainer


def _train(data, out, module, steps):
    trainer = make_trainer(base_args(data, out, steps=steps, extra=["--network_module", module,
                                                                    "--learning_rate", "1e-2"]))
    path = trainer.run()
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def test_lora_fa_freezes_lora_down_and_saves_the_lora_layout(tmp_path):
    data = make_dataset(str(tmp_path), n=1)
    one, md = _train(data, str(tmp_path / "a"), "networks.lora_fa", 1)
    three, _ = _train(data, str(tmp_path / "b"), "networks.lora_fa", 3)
    plain, _ = _train(data, str(tmp_path / "c"), "networks.lora", 1)
    # sd-scripts' lora_fa.py saves lora.py's keys; networks.lora's are checked against sd-scripts elsewhere
    assert {k: v.shape for k, v in one.items()} == {k: v.shape for k, v in plain.items()}
    assert len(one) == 792
    downs = [k for k in one if k.endswith("lora_down.weight")]
    ups = [k for k in one if k.endswith("lora_up.weight")]
    assert len(downs) == len(ups) == 264
    assert all(torch.equal(one[k], three[k]) for k in downs)  # the same seed draws A; training never moves it
    assert all(not torch.equal(one[k], three[k]) for k in ups)
    # the paper's init of A, not networks.lora's kaiming: std sqrt(2 / (in + rank)) per module
    k = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight"
    assert abs(float(one[k].std()) - (2 / (32 + 4)) ** 0.5) < 0.05
    assert md["ss_network_module"] == "networks.lora_fa"


def test_lora_fa_optimizer_groups_hold_only_lora_up(tiny_sd1):
    from networks.lora_fa import create_network

    c = tiny_sd1
    network = create_network(1.0, 4, 4, c.vae, c.text_encoders[0], c.denoiser)
    groups, names = network.prepare_optimizer_params(1e-4, 1e-3, 1e-3)
    params = {id(p) for g in groups for p in g["params"]}
    ups = {id(m.lora_up.weight) for m in network.text_encoder_loras + network.unet_loras}
    assert names == ["textencoder", "unet"] and params == ups
    assert all(not m.lora_down.weight.requires_grad for m in network.unet_loras)
