"""The Stable Diffusion 3 / 3.5 family: `family.py` holds its ModelFamily class; the other modules are named by role."""
