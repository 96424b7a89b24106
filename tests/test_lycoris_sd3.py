"""--network_module lycoris.kohya on SD3 (tiny:sd3): LoCon and LoHa train one step, save under the `lycoris_<diffusers
path>` names ComfyUI maps onto SD3, and rebuild in LyCORIS with the trained outputs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from library.families.base import LoadOptions
from library.train.adapters.network_kinds import network_kind
from library.train.adapters.network_setup import external_state_dict
from library.train.settings import NetworkOptions
from tests.train_helpers import base_args, make_dataset, make_trainer

pytest.importorskip("lycoris.kohya")

PARTS = {"locon": ["alpha", "lora_down.weight", "lora_up.weight"],
         "loha": ["alpha", "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"]}
# Besides the joint blocks (SD3's blocks are aliased to LyCORIS' SingleDiTBlock), LyCORIS' preset takes the patch
# embedding's conv and diffusers' TimestepEmbedding.
OUTSIDE = ["lycoris_pos_embed_proj", "lycoris_time_text_embed_timestep_embedder_linear_1",
           "lycoris_time_text_embed_timestep_embedder_linear_2"]


def sd3_output(family, components) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        text = family.encode_text(components, family.tokenize(components, ["sks toy"], None), None)
        return family.predict(components, torch.randn(1, 16, 8, 8, generator=g), torch.tensor([500]), text, {})


@pytest.mark.parametrize("algo", list(PARTS))
def test_lycoris_algo_trains_saves_and_reloads_on_sd3(tmp_path, algo):
    data = make_dataset(str(tmp_path), n=1)
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), "tiny:sd3", steps=1, extra=[
        "--network_module", "lycoris.kohya", "--learning_rate", "1e-2", "--t5xxl_max_token_length", "8",
        "--cache_text_encoder_outputs", "--network_train_unet_only", "--network_args", f"algo={algo}"]), "sd3")
    path = trainer.run()
    saved = load_file(path)
    transformer = trainer.components.denoiser
    blocks = [f"lycoris_{n.replace('.', '_')}" for n, m in transformer.named_modules()
              if n.startswith("transformer_blocks.") and isinstance(m, nn.Linear)]
    assert sorted({k.split(".", 1)[0] for k in saved}) == sorted(blocks + OUTSIDE)
    assert "lycoris_transformer_blocks_0_attn2_to_q" in blocks  # tiny:sd3 is SD3.5 medium: dual attention
    assert sorted({k.split(".", 1)[1] for k in saved}) == PARTS[algo]
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    assert (metadata["ss_network_module"], json.loads(metadata["ss_network_args"])) == ("lycoris.kohya",
                                                                                      {"algo": algo})

    family = trainer.family
    trainer.accelerator.unwrap_model(trainer.network).eval()
    trained = sd3_output(family, trainer.components)
    fresh = family.load(LoadOptions("tiny:sd3", family_options=trainer.components.options))
    assert not torch.allclose(sd3_output(family, fresh), trained), "training changed nothing"
    network = network_kind("lycoris.kohya").create(family, fresh, NetworkOptions(
        network_module="lycoris.kohya", network_dim=4, network_alpha=4, network_args={"algo": algo}))
    network.apply_to(fresh.text_encoders, fresh.denoiser, False, True)
    missing, unexpected = network.load_state_dict(external_state_dict(path, family, fresh), strict=False)
    assert not unexpected and not [k for k in missing if not k.endswith("org_weight")], (missing, unexpected)
    network.eval()
    torch.testing.assert_close(sd3_output(family, fresh), trained, rtol=1e-4, atol=1e-5)
