"""A tiny trained Qwen3.5-format VLM and the synthetic world it answers questions about (see models/demo)."""
