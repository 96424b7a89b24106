"""Each family declares its own facts (library/families/*/family.py); the registry, the tools and (until the form
reads --describe_flags) the web UI's tables agree with them."""

import json

from library.families import DEFAULT_FAMILY, family_names, get_family, registered_families, selected_family
from webui import jobfiles, performance


def test_facts_are_json_and_complete():
    facts = {name: json.loads(json.dumps(get_family(name).facts())) for name in family_names()}
    assert facts["flux"]["scripts"] == {"lora": "flux_train_network.py", "finetune": "flux_train.py"}
    assert facts["chroma"]["variant_of"] == "flux" and facts["chroma"]["model_types"] == ["chroma"]
    assert facts["hunyuan_image"]["flag_aliases"] == {"fp8_scaled": "fp8_base_unet"}
    assert facts["sd"]["tiny_presets"] == ["tiny:sd1", "tiny:sd2", "tiny:sd2-v"]
    assert facts["sd3"]["component_file_flags"] == ["clip_l", "clip_g", "t5xxl"]
    assert [n for n in family_names() if facts[n]["block_swap"]] == ["anima", "chroma", "flux", "hunyuan_image",
                                                                      "lumina", "sd3", "zimage"]


def test_the_web_ui_tables_say_what_the_families_say():
    """webui/ cannot import the families; its tables must match their facts until it reads --describe_flags."""
    scripts = {(f.name, mode): script for f in registered_families() for mode, script in f.scripts.items()}
    assert jobfiles.SCRIPTS == scripts
    assert jobfiles.MODEL_TYPES == {f.name: f.model_types for f in registered_families() if f.model_types}
    assert sorted(performance.BLOCK_SWAP_FAMILIES) == sorted(f.name for f in registered_families()
                                                             if f.supports_block_swap())


def test_selector_flags_pick_a_family_as_sd_scripts_tools_do():
    assert selected_family({"sdxl": True, "flux": True}) == "sdxl"  # the first registered selector wins
    assert selected_family({"flux": True}) == "flux"
    assert selected_family({"flux": False}) is None
    assert DEFAULT_FAMILY == "sd"
