"""Qwen-Image (Alibaba Qwen team): a 20B MMDiT on Qwen2.5-VL text and a Wan-style 16-channel VAE."""
