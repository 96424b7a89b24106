"""FLUX.2 (Black Forest Labs; klein and dev): the MMDiT (diffusers Flux2Transformer2DModel), Qwen3 (klein) or
Mistral-Small-3.1 (dev) text, the 32-channel AE."""
