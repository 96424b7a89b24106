"""The Stable Diffusion 1.x / 2.x family: `family.py` holds its ModelFamily class; the other modules are named by role."""
