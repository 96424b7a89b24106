"""The Stable Diffusion XL family: `family.py` holds its ModelFamily class; the other modules are named by role."""
