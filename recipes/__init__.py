"""Training recipes for the bundled checkpoints (tokenizer, data, SDAR-style block-diffusion training)."""
