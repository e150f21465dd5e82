"""The adapter store sidecar (``loraplex-store``): validated, versioned PEFT LoRA adapters.

Layers: ``backends/`` (blobs: local directory or S3; index, blob cache and change feed:
in memory or Redis) -> ``store.Store`` (upload, read, list, delete, watch; plain Python,
thread-safe, no gRPC) -> ``service`` (the gRPC AdapterStore servicer) -> ``main`` (the
console script). ``client.StoreClient`` is the inference server's AdapterSource over gRPC;
``embedded.InProcessStoreSource`` is the same over an in-process Store.
"""
