"""Llama-family decoder as plain nn.Modules, and its loaders (HF folder, GGUF, dummy)."""
