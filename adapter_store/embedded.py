"""The AdapterSource over an in-process Store (the embedded default: no sidecar process)."""

from __future__ import annotations

from collections.abc import Mapping

from loraplex.adapter_store.format.files import AdapterFiles, AdapterInfo
from loraplex.adapter_store.format.peft_format import parse_adapter_files
from loraplex.adapter_store.store import Store

LIST_PAGE = 1000


class InProcessStoreSource:
    """loraplex.adapter_store.format.files.AdapterSource backed by a Store in this process."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def resolve(self, adapter_id: str) -> AdapterFiles:
        record, files = self.store.fetch(adapter_id)
        spec = parse_adapter_files(files, self.store.base, self.store.max_rank, record.info.pattern_values)
        return AdapterFiles(record.info, spec, files)

    def get(self, adapter_id: str) -> AdapterInfo:
        return self.store.stat(adapter_id).info

    def list(self) -> list[AdapterInfo]:
        out: list[AdapterInfo] = []
        after = ""
        while True:
            page = self.store.list("", after, LIST_PAGE)
            out.extend(r.info for r in page)
            if len(page) < LIST_PAGE:
                return out
            after = page[-1].adapter_id

    def put(self, adapter_id: str, files: Mapping[str, bytes], public: bool = False) -> AdapterInfo:
        return self.store.put(adapter_id, files, public).info

    def delete(self, adapter_id: str) -> None:
        self.store.delete(adapter_id)
