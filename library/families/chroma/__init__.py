"""The Chroma (FLUX.1 blocks with a distilled guidance approximator) family: `family.py` holds its ModelFamily class; the other modules are named by role."""
