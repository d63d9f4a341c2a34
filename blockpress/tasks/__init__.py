"""Task definitions (data generation, tokenization, verification) for block-diffusion models."""
