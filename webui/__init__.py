"""The training-job web UI (issue 14): a front for the command line that exists.

Every job is a `--config_file` TOML plus a dataset TOML in the job's folder, run as a subprocess
(`python <script> --config_file ...` or `accelerate launch ...`). This package never imports the trainer:
it talks to training only through command lines, files and process signals (.importlinter checks it).
"""
