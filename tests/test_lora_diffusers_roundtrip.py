"""A LoRA saved by networks.lora loads in diffusers' `load_lora_weights` with every key used,
and diffusers computes what our network computes."""

import copy
import logging

import torch

from networks import lora


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _pipeline(modules):
    from diffusers import DDPMScheduler, StableDiffusionPipeline

    scheduler = DDPMScheduler.from_config({"num_train_timesteps": 1000, "beta_schedule": "scaled_linear",
                                           "beta_start": 0.00085, "beta_end": 0.012, "clip_sample": False})
    return StableDiffusionPipeline(vae=modules["vae"], text_encoder=modules["text_encoder"],
                                   tokenizer=modules["tokenizer"], unet=modules["unet"], scheduler=scheduler,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def _outputs(modules, ids, latents):
    with torch.no_grad():
        hidden = modules["text_encoder"](ids).last_hidden_state
        return hidden, modules["unet"](latents, 500, hidden).sample


def _close(a, b):
    return torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))


def test_diffusers_load_lora_weights_matches_our_network(tmp_path, tiny_sd1_modules):
    from peft.tuners.lora import LoraLayer

    # three private copies: ours gets the network hooked in, theirs diffusers' LoRA layers, merged the merge
    ours, theirs, merged = (copy.deepcopy(tiny_sd1_modules) for _ in range(3))
    # conv_dim: Linear, 1x1 and 3x3 conv modules all take part
    net = lora.create_network(1.0, 4, 2, None, ours["text_encoder"], ours["unet"], conv_dim="4", conv_alpha="2")
    g = torch.Generator().manual_seed(0)
    for m in net.unet_loras + net.text_encoder_loras:  # a trained-looking LoRA
        m.lora_up.weight.data = torch.randn(m.lora_up.weight.shape, generator=g) * 0.05
    path = str(tmp_path / "trained.safetensors")
    net.save_weights(path, torch.float32, {"ss_network_module": "networks.lora"})

    pipe = _pipeline(theirs)
    records = _Records()
    diffusers_logger = logging.getLogger("diffusers")
    diffusers_logger.addHandler(records)
    try:
        pipe.load_lora_weights(path, adapter_name="ours")
    finally:
        diffusers_logger.removeHandler(records)
    assert not [m for m in records.messages if "unexpected" in m.lower() or "missing" in m.lower()
                or "not" in m.lower() and "load" in m.lower()]
    peft_unet = sum(isinstance(m, LoraLayer) for m in pipe.unet.modules())
    peft_te = sum(isinstance(m, LoraLayer) for m in pipe.text_encoder.modules())
    assert (peft_unet, peft_te) == (len(net.unet_loras), len(net.text_encoder_loras))

    ids = torch.tensor([[49406] + list(range(300, 306)) + [49407]]).clamp(
        max=ours["text_encoder"].config.vocab_size - 1)
    latents = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    base_hidden, base_pred = _outputs(merged, ids, latents)
    net.apply_to(ours["text_encoder"], ours["unet"])
    our_hidden, our_pred = _outputs(ours, ids, latents)
    their_hidden, their_pred = _outputs(theirs, ids, latents)
    assert not _close(our_pred, base_pred)  # the LoRA changes the outputs...
    assert _close(their_hidden, our_hidden)  # ...and diffusers applies it exactly as we do
    assert _close(their_pred, our_pred)

    merger, weights = lora.create_network_from_weights(1.0, path, None, merged["text_encoder"], merged["unet"])
    merger.merge_to(merged["text_encoder"], merged["unet"], weights, torch.float32, "cpu")
    merged_hidden, merged_pred = _outputs(merged, ids, latents)
    assert _close(merged_hidden, our_hidden)
    assert _close(merged_pred, our_pred)
