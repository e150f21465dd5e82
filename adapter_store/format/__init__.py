"""The adapter format: PEFT LoRA files (adapter_config.json + adapter_model.safetensors),
validated here for the store's uploads and the server's loads alike: ids (naming), the config
and tensors (peft_format, patterns, safetensors_header), what they must fit (base_shapes), and
the validated files with their info (files)."""
