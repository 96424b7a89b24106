"""The Anima (Cosmos-Predict2 DiT with a Qwen3 text encoder) family: `family.py` holds its ModelFamily class; the other modules are named by role."""
