"""Fine-tune the whole FLUX.1 model (sd-scripts compatible flags).

    accelerate launch flux_train.py --pretrained_model_name_or_path MODEL --dataset_config data.toml \
        --output_dir out --output_name my_model --save_model_as safetensors --learning_rate 1e-5
"""

from library.core import stop_signals

stop_signals.install_at_start()  # first: a stop signal during the imports below is kept (docs/resume.md)

import sys  # noqa: E402

from library.cli.entry import run_training  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_training("flux", "Fine-tune FLUX.1 (the model's own weights)", fine_tune=True))
