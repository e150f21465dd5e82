"""LoRA runtime in four tiers: kernels (kernels/) -> batch metadata (batch.py) -> LoRA
layers (layers.py) -> adapter manager (manager.py: pool, residency, loading)."""
