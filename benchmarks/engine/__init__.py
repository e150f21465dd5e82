"""The engine in one process: decode steps, text generation, the adapter pool's tiers, grammar masks."""
