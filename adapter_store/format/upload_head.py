"""The head of an upload still on its way: its config and its weights' safetensors header, kept as
the files pass back to back in declared order, and checked against a base model
(``peft_format.check_upload_head``) as soon as both are in, so that an adapter that does not fit
is refused before its weights follow. The rest of the bytes pass by unkept.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from loraplex.adapter_store.assembly import DeclaredFile
from loraplex.adapter_store.format.base_shapes import BaseShapes
from loraplex.adapter_store.format.peft_config import CONFIG_FILE
from loraplex.adapter_store.format.peft_format import WEIGHTS_FILE, check_file_names, check_upload_head
from loraplex.adapter_store.format.safetensors_header import MAX_HEADER_BYTES

MAX_CONFIG_BYTES = 1 << 20  # a config declared larger is left to the whole upload's parse


class UploadHead:
    """Feed it the stream's bytes in order; ``feed`` raises AdapterValidationError once the head is
    in and does not fit. The declared names are checked at once (pickles, the two files PEFT needs)."""

    def __init__(self, declared: Sequence[DeclaredFile], base: BaseShapes | None, max_rank: int) -> None:
        check_file_names(f.name for f in declared)
        self._base, self._max_rank = base, max_rank
        self._spans: dict[str, tuple[int, int]] = {}
        start = 0
        for f in declared:
            self._spans[f.name] = (start, f.size)
            start += f.size
        self._kept = {CONFIG_FILE: bytearray(), WEIGHTS_FILE: bytearray()}
        self._weights_size = self._spans[WEIGHTS_FILE][1]
        self._need = {CONFIG_FILE: self._spans[CONFIG_FILE][1], WEIGHTS_FILE: min(8, self._weights_size)}
        self._pos = 0
        self.checked = self._need[CONFIG_FILE] > MAX_CONFIG_BYTES  # nothing left to check here

    def feed(self, data: bytes) -> None:
        if not self.checked:
            for name in self._kept:
                self._keep(name, data)
            if self._grow_weights_need():
                self._keep(WEIGHTS_FILE, data)  # the rest of the header this data holds
            if all(len(self._kept[n]) >= self._need[n] for n in self._kept):
                self.checked = True
                check_upload_head(bytes(self._kept[CONFIG_FILE]), bytes(self._kept[WEIGHTS_FILE]),
                                  self._weights_size, self._base, self._max_rank)
        self._pos += len(data)

    def _keep(self, name: str, data: bytes) -> None:
        """Keep what ``data`` (at the stream's position) holds of file ``name``'s bytes still needed."""
        kept = self._kept[name]
        begin = self._spans[name][0] + len(kept)  # the file's next byte not kept yet
        lo, hi = max(begin, self._pos), min(begin + self._need[name] - len(kept), self._pos + len(data))
        if lo < hi:
            kept += data[lo - self._pos : hi - self._pos]

    def _grow_weights_need(self) -> bool:
        """Once the weights' first 8 bytes are in, the head is them and the header they announce
        (True when that grew what is needed)."""
        kept = self._kept[WEIGHTS_FILE]
        if len(kept) < 8 or self._need[WEIGHTS_FILE] > 8:
            return False
        (n,) = struct.unpack("<Q", kept[:8])
        if n > MAX_HEADER_BYTES:  # read_header refuses it from the 8 bytes alone
            return False
        self._need[WEIGHTS_FILE] = min(8 + n, self._weights_size)
        return self._need[WEIGHTS_FILE] > 8
