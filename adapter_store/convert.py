"""Domain objects <-> AdapterStore protobuf messages (gRPC stays at the edge)."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from loraplex.adapter_store.errors import InvalidRequestError
from loraplex.adapter_store.format.architectures import Dims
from loraplex.adapter_store.format.base_shapes import BaseShapes, HFBaseShapes
from loraplex.adapter_store.format.files import AdapterInfo
from loraplex.adapter_store.format.pattern_decisions import PatternValue
from loraplex.adapter_store.records import KIND_DELETE, KIND_PUT, KIND_RESYNC, ChangeEvent, FileEntry, StoredRecord
from loraplex.v1 import store_pb2 as pb

_KINDS = {
    KIND_PUT: pb.StoreWatchEvent.KIND_PUT,
    KIND_DELETE: pb.StoreWatchEvent.KIND_DELETE,
    KIND_RESYNC: pb.StoreWatchEvent.KIND_RESYNC,
}
_KINDS_BACK = {v: k for k, v in _KINDS.items()}


def _timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(round(seconds * 1e9))
    return ts


def record_to_pb(record: StoredRecord) -> pb.StoredAdapter:
    info = record.info
    return pb.StoredAdapter(
        adapter_id=info.adapter_id,
        version=info.version,
        sha256=info.sha256,
        rank=info.rank,
        lora_alpha=info.lora_alpha,
        target_modules=list(info.target_modules),
        dtype=info.dtype,
        size_bytes=info.size_bytes,
        created_at=_timestamp(info.created_at),
        files=[pb.StoredFile(name=f.name, size=f.size, sha256=f.sha256) for f in record.files],
        public=info.public,
        patterns_decided=info.pattern_values is not None,
        pattern_values=[pb.PatternValue(layer=v.layer, module=v.module, rank=v.rank, alpha=v.alpha)
                        for v in info.pattern_values or ()],
    )


def record_from_pb(msg: pb.StoredAdapter) -> StoredRecord:
    info = AdapterInfo(
        adapter_id=msg.adapter_id,
        version=msg.version,
        sha256=msg.sha256,
        rank=msg.rank,
        lora_alpha=msg.lora_alpha,
        target_modules=tuple(msg.target_modules),
        dtype=msg.dtype,
        size_bytes=msg.size_bytes,
        created_at=msg.created_at.ToNanoseconds() / 1e9,
        public=msg.public,
        pattern_values=tuple(PatternValue(v.layer, v.module, v.rank, v.alpha) for v in msg.pattern_values)
        if msg.patterns_decided else None,
    )
    return StoredRecord(info, tuple(FileEntry(f.name, f.size, f.sha256) for f in msg.files))


def event_to_pb(event: ChangeEvent) -> pb.StoreWatchEvent:
    return pb.StoreWatchEvent(
        kind=_KINDS[event.kind],
        adapter_id=event.adapter_id,
        version=event.version,
        sha256=event.sha256,
        time=_timestamp(event.time),
    )


def event_from_pb(msg: pb.StoreWatchEvent) -> ChangeEvent:
    if msg.kind not in _KINDS_BACK:
        raise ValueError(f"unknown watch event kind {msg.kind}")
    return ChangeEvent(_KINDS_BACK[msg.kind], msg.adapter_id, msg.version, msg.sha256, msg.time.ToNanoseconds() / 1e9)


def base_model_to_pb(base: BaseShapes, max_rank: int) -> pb.StoreBaseModel:
    d = base.dims
    return pb.StoreBaseModel(model_type=base.model_type, num_layers=d.num_layers, hidden=d.hidden,
                             intermediate=d.intermediate, q=d.q, kv=d.kv, max_rank=max_rank)


def base_model_from_pb(msg: pb.StoreBaseModel) -> tuple[HFBaseShapes, int]:
    """(the base, its rank cap) an Import names; InvalidRequestError naming ``base`` if unusable."""
    try:
        dims = Dims(num_layers=msg.num_layers, hidden=msg.hidden, intermediate=msg.intermediate, q=msg.q, kv=msg.kv)
        base = HFBaseShapes(model_type=msg.model_type, dims=dims)
        base.architecture  # noqa: B018  (an unknown model type is refused here, by name)
    except (ValueError, KeyError) as e:
        raise InvalidRequestError(f"is not a base model loraplex serves ({e})", "base") from None
    if msg.max_rank < 1:
        raise InvalidRequestError("max_rank must be >= 1", "base") from None
    return base, msg.max_rank
