"""Names the dead-code check (tests/test_architecture.py, vulture) must not report: each is read by name from
outside Python's view (a library calling a method, a dataclass read field by field, a pytest fixture asked for its
side effect). Grouped by why; allow-list by name, never by file. A name that is really unused is deleted, not listed.

vulture reads this file as code that "uses" the names below; it is never imported.
"""
# ruff: noqa
# fmt: off
_ = object()

# sd-scripts' network API and module constants (networks/lora.py): sd-scripts' train_network.py, other GUIs and
# scripts written against sd-scripts' networks.lora call or import them.
_.on_step_start
_.get_trainable_params
NUM_OF_BLOCKS
UNET_TARGET_REPLACE_MODULE
UNET_TARGET_REPLACE_MODULE_CONV2D_3X3
TEXT_ENCODER_TARGET_REPLACE_MODULE
LORA_PREFIX_UNET
LORA_PREFIX_TEXT_ENCODER
LORA_PREFIX_TEXT_ENCODER1
LORA_PREFIX_TEXT_ENCODER2

# Python's isinstance / issubclass call these on a metaclass (library/families/common/diffusers_import.py)
_.__instancecheck__
_.__subclasscheck__

# torch / sqlite / transformers / tokenizers / onnx / uvicorn / selenium / mock attributes set or overridden for the
# library that reads them
_.get_lr                 # torch LRScheduler.get_lr, called by LRScheduler.step
closure                  # torch Optimizer.step(closure=None) signature
set_to_none              # torch Optimizer.zero_grad(set_to_none=True) signature
_.row_factory            # sqlite3.Connection.row_factory
_.prompt_template_encode_start_idx  # diffusers QwenImagePipeline attribute set for the tiny tokenizer
model_config             # pydantic BaseModel configuration (webui/routes/models.py)
_.log_message            # http.server handler methods of the stand-in Hub (tests/hub_standin.py)
_.do_POST
do_HEAD
_.pre_tokenizer          # tokenizers.Tokenizer parts of the tiny tokenizers
_.chat_template          # a tokenizer's chat template (tiny Qwen3 tokenizers), read by apply_chat_template
_.normalizer
_.decoder
_.post_processor
_.padding_side           # transformers tokenizer setting
_.relative_attention_num_buckets  # transformers T5 config
_.architectures          # transformers config.architectures written into saved configs
_.__class__              # a module's class swapped in place
_.__loader__             # a module's loader, read by importlib / inspect (library/families/common/deferred_backends.py)
_.ir_version             # onnx ModelProto field
_.should_exit            # uvicorn.Server.should_exit
_.binary_location        # selenium ChromeOptions
_.return_value           # unittest.mock
_.shortcut
_.deepspeed_fields_from_accelerate_config  # monkeypatched in a test

# Flag and settings dataclass fields read generically (library/cli/options.py flag_specs / settings_from,
# dataclasses.asdict into metadata or cache signatures), never as attributes
metadata_title
metadata_author
metadata_description
metadata_license
metadata_tags
training_comment
sdpa                     # sd-scripts flags accepted for compatibility (library/cli/training.py COMPATIBILITY_FLAGS)
mem_eff_attn
custom_attributes        # dataset config key (sd-scripts' custom_attributes), carried as data
mask_source              # part of the latent cache signature (asdict)
llm_adapter_lr           # family options: flags declared as fields, read by name
self_attn_lr
cross_attn_lr
mlp_lr
mod_lr
unsloth_offload_checkpointing
fp8_scaled
fp8_vl
text_encoder_cpu
use_flash_attn
use_sage_attn
metadata_usage_hint      # modelspec flags, written through flag_values (library/cli/fine_tune.py MetadataFlags)
metadata_thumbnail
metadata_merged_from
metadata_trigger_phrase
metadata_preprocessor
metadata_is_negative_embedding
no_token_padding         # sd-scripts flags accepted as documented no-ops or read by name (docs/differences.md)
use_safetensors
use_t5xxl_cache_only
split_mode               # deprecated sd-scripts spellings read by name (blocks_to_swap_with_aliases)
double_blocks_to_swap
single_blocks_to_swap
text_encoder_batch_size
disable_mmap_load_safetensors
t5xxl_device
t5xxl_dtype
save_clip
save_t5xxl
posterior                # part of the latent cache signature (asdict)

# Family constants kept as documentation of a file format; families are being moved into packages (issue 23
# item 1), delete them there rather than here.
BYT5_REAL_VOCAB_SIZE
FUSED_QKV
SINGLE_FILE_FORMATS

# pytest: fixtures requested for their side effect, module marks, results unpacked for one half
no_training
one_process_group
fresh_warnings
shared_tiny_models
pytestmark
fastapi                  # pytest.importorskip result
base_pool
base_hidden

# diffusers' hooks read these from the model (library/train/distributed/context_parallel.py resolves the CPU mesh)
_parallel_config
_resolve_parallel_config

# diffusers modules imported without peft read their BaseTunerLayer stand-in (common/diffusers_import.py)
_.BaseTunerLayer
