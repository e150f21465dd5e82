"""The adapter pool: residency of adapters on the GPU over a pinned host tier and a source.

``adapter_pool`` (AdapterPool: acquire / release, LRU, the loader thread) over
``range_allocator`` (places in the flat pool tensor), ``host_cache`` (the pinned host tier),
``packing`` / ``device_packing`` (an adapter's flat layout, on the CPU or on the device),
``copier`` and ``pool_writes`` (host -> device copies on a side stream, announced to the
step loop), ``tensor_views`` (zero-copy tensors over safetensors bytes) and ``pool_stats``.
"""
