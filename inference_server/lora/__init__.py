"""The LoRA runtime in tiers, lowest first; a tier imports only the tiers below it.

1. ``local_directory``: the embedded adapter source (the adapter format itself, PEFT
   validation and the AdapterSource interface, is adapter_store/format/).
2. ``resident``: an adapter's place in the GPU pool, as the per-step tables read it.
3. ``batch``: the per-step segment tables the kernels read (SGMV / BGMV operands).
4. ``layers``: the LoRA-wrapped projections the model calls.
5. ``pool/``: the adapter pool (device pool, pinned host tier, LRU, async copies, packing).
6. ``managed_adapters``: the pool bound to an adapter source and its change feed.
"""
