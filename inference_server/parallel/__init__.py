"""Tensor parallelism (Megatron-style) for the Llama engine, applied to the built model from outside.

One process per rank. Rank 0 is the server: scheduler, adapter bookkeeping, gRPC edge; each
step it broadcasts a plain-Python ``StepPlan`` (and any adapter loads) to the workers, and all
ranks run the same forward on their shard. Modules:

- ``group``: the process group (NCCL on CUDA, gloo on the CPU; a gloo control group for
  pickled metadata) and the few collectives the model needs;
- ``shard``: which slice of every tensor a rank keeps, the sharded loader, the module surgery;
- ``layers``: vocab-parallel embedding, row-parallel linear, the logits gather;
- ``lora``: S-LoRA sharding of adapters (pack per rank) and the LoRA wrappers;
- ``adapters``: the rank-0 adapter manager that also ships each worker its shard;
- ``plan``: one step's metadata as plain data, and the forward every rank runs from it;
- ``runner`` / ``worker`` / ``launch``: rank 0's runner, the worker loop, process start-up.
"""
