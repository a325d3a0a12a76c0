"""HF <-> Megatron checkpoint conversion; `tools/convert_hf` holds thin CLIs over it."""
