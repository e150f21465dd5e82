"""Which engine a config asks for: one process (engine/factory.py), or the model sharded
over ``tensor_parallel_size`` processes (inference_server/parallel/launch.py, which builds on
the factory's pieces). It sits above both: the engine never imports the parallel code."""

from __future__ import annotations

from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.engine.factory import build_local_engine
from loraplex.inference_server.model.checkpoint import ModelSource


def build_engine(cls, config: EngineConfig, model: ModelSource, adapters, progress: bool = True):
    """Load the model (blocking: call it in a thread) and wire an engine of class ``cls``
    (AsyncEngine) together. ``adapters``: an AdapterSource, or a folder path for a
    LocalAdapterDirectory.
    ``config.tensor_parallel_size`` > 1 starts the sharded engine (inference_server/parallel)."""
    if config.tensor_parallel_size > 1:
        # only here: it brings in torch.distributed and the worker processes' code
        from loraplex.inference_server.parallel.launch import build_parallel_engine  # noqa: PLC0415

        return build_parallel_engine(cls, config, model, adapters, progress)
    return build_local_engine(cls, config, model, adapters, progress)
