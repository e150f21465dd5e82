"""Open a model's checkpoint with the reader its format needs (hf_folder, gguf_file, dummy).

``load_checkpoint`` returns a Checkpoint (checkpoint.py) whose tensors stream one at a time,
cast to the requested dtype, optionally behind a progress bar.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from loraplex.inference_server.model.checkpoint import DTYPES, Checkpoint, ModelSource, TensorStream


def load_checkpoint(source: ModelSource, dtype: torch.dtype = torch.float32, progress: bool = False) -> Checkpoint:
    """Open ``source``: parse its config and tokenizer now, stream its tensors later.

    ``progress`` shows a tqdm bar while the tensors are read.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; supported: float32, bfloat16, float16")
    src = source.resolved()
    if src.format == "hf":
        from loraplex.inference_server.model import hf_folder as reader
    elif src.format == "gguf":
        from loraplex.inference_server.model import gguf_file as reader
    else:
        from loraplex.inference_server.model import dummy as reader
    ckpt = reader.open_checkpoint(src, dtype)
    if not progress:
        return ckpt
    return Checkpoint(
        config=ckpt.config, tokenizer=ckpt.tokenizer, tensors=_with_progress(ckpt), num_tensors=ckpt.num_tensors,
        dtype=ckpt.dtype, description=ckpt.description,
    )


def _with_progress(ckpt: Checkpoint) -> TensorStream:
    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        from tqdm import tqdm

        with tqdm(total=ckpt.num_tensors, desc=f"loading {ckpt.description}", unit="tensor") as bar:
            for item in ckpt.tensors():
                yield item
                bar.update(1)

    return stream
