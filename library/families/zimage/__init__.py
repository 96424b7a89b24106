"""Z-Image (Tongyi-MAI): the S3-DiT, Qwen3 text, the FLUX.1 autoencoder."""
