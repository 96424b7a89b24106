"""FLUX.2 (Black Forest Labs; klein): the MMDiT (diffusers Flux2Transformer2DModel), Qwen3 text, the 32-channel AE."""
