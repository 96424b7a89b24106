"""Each family declares its own facts (library/families/*/family.py); the registry, the tools and the web UI (which
learns them from `python -m library.cli.describe --describe_families`) agree with them."""

import json

from library.families import DEFAULT_FAMILY, family_names, get_family, registered_families, selected_family
from library.cli.describe import describe_families
from webui import families as webui_families


def test_facts_are_json_and_complete():
    facts = {name: json.loads(json.dumps(get_family(name).facts())) for name in family_names()}
    assert facts["flux"]["scripts"] == {"lora": "flux_train_network.py", "finetune": "flux_train.py",
                                        "controlnet": "flux_train_control_net.py"}
    assert facts["chroma"]["variant_of"] == "flux" and facts["chroma"]["model_types"] == ["chroma"]
    assert facts["hunyuan_image"]["flag_aliases"] == {"fp8_scaled": "fp8_base_unet"}
    assert facts["sd"]["tiny_presets"] == ["tiny:sd1", "tiny:sd2", "tiny:sd2-v"]
    assert facts["sd3"]["component_file_flags"] == ["clip_l", "clip_g", "t5xxl"]
    assert [n for n in family_names() if facts[n]["block_swap"]] == ["anima", "chroma", "flux", "flux2",
                                                                      "hunyuan_image", "lumina", "qwen_image", "sd3",
                                                                      "zimage"]


def test_the_web_ui_learns_every_family_from_the_trainer():
    """webui/ imports no trainer code: it runs --describe_families once, and what it learns is the registry's."""
    learned = webui_families.families()
    assert learned == {f["name"]: f for f in json.loads(json.dumps(describe_families()))["families"]}
    assert list(learned) == [f.name for f in registered_families()]
    assert {(name, mode): webui_families.script_for(name, mode) for name in learned for mode in learned[name]["scripts"]} \
        == {(f.name, mode): script for f in registered_families() for mode, script in f.scripts.items()}
    assert webui_families.block_swap_families() == ["flux", "chroma", "anima", "sd3", "lumina", "hunyuan_image", "zimage",
                                                   "qwen_image", "flux2"]
    assert webui_families.all_scripts()[:3] == ["anima_train.py", "anima_train_network.py", "fine_tune.py"]
    assert webui_families.model_type_refusal("flux", {"model": {"model_type": "flux"}}) is None
    assert webui_families.model_type_refusal("chroma", {}) == (
        'model_type: a chroma job needs model_type "chroma" (its scripts train the model it names), got blank',
        "model_type")


def test_selector_flags_pick_a_family_as_sd_scripts_tools_do():
    assert selected_family({"sdxl": True, "flux": True}) == "sdxl"  # the first registered selector wins
    assert selected_family({"flux": True}) == "flux"
    assert selected_family({"flux": False}) is None
    assert DEFAULT_FAMILY == "sd"
