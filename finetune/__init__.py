"""sd-scripts' finetune/ dataset tools: captioners, taggers, metadata merge/clean, bucket + latent preparation."""
