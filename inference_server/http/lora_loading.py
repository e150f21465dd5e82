"""vLLM's runtime LoRA endpoints (``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``):
where a ``lora_path`` points, and the adapter files read from there.

``lora_path`` is one of: ``s3://bucket/prefix`` (imported by the adapter store sidecar with its
own S3 client and credentials: ``S3Path``; this process reads no S3, and without a store such a
path is refused naming ``--adapter-store``), a folder on the server as an absolute path, or the
id of an adapter already stored. Anything else is an id: a relative path is never looked up in
the server's working directory (``rnd`` is the stored adapter ``rnd`` even where a folder
``rnd`` is there), and one that is no valid id (``./rnd``) is refused. A folder's files then go
through the same validation and store as an UploadAdapter call (``EdgeAdapters.put``), and the
adapter is loaded into the device pool. A
folder or a bucket is read with the server's (or its store's) file system and credentials, so
with ``--auth tokens`` only an admin may name one; a tenant may load a stored adapter it can read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loraplex.adapter_store.errors import AdapterNotFoundError, InvalidRequestError, PermissionDeniedError
from loraplex.adapter_store.format.naming import validate_adapter_id
from loraplex.inference_server.engine.api import EdgeAdapters
from loraplex.inference_server.http.errors import HttpError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_FILES = (CONFIG_FILE, WEIGHTS_FILE)  # what is read (a PEFT folder's other files, pickles included, are not)
_FORMS = "an absolute folder path on the server, an s3://bucket/prefix or a stored adapter id"


@dataclass(frozen=True, slots=True)
class S3Path:
    """A ``lora_path`` of ``s3://bucket/prefix``: the adapter store imports it (EdgeAdapters.import_s3)."""

    url: str


def lora_files(lora_path: str, adapters: EdgeAdapters, may_read_server: bool, max_bytes: int,
               may_read: Callable[[str, bool], bool]) -> dict[str, bytes] | str | S3Path:
    """The PEFT files ``lora_path`` names, the id of the stored adapter it names (str), or the
    S3 prefix it names (for the store to import).
    ``may_read_server``: whether the caller may have the server read its folders and buckets;
    ``may_read(adapter_id, public)``: whether the caller may read a stored adapter (the tenant
    rules: another tenant's private adapter is not found, as it is for generate and show)."""
    if not lora_path:
        raise InvalidRequestError("must be non-empty", "lora_path")
    if lora_path.startswith("s3://"):
        _check_may_read(may_read_server, lora_path)
        if not lora_path.removeprefix("s3://").partition("/")[0]:
            raise InvalidRequestError(f"{lora_path!r} names no bucket (s3://bucket/prefix)", "lora_path")
        return S3Path(lora_path)
    folder = Path(lora_path)
    if folder.is_absolute():
        _check_may_read(may_read_server, lora_path)
        return _folder_files(folder, max_bytes)
    return _stored_id(lora_path, adapters, may_read)


def _stored_id(lora_path: str, adapters: EdgeAdapters, may_read: Callable[[str, bool], bool]) -> str:
    """``lora_path`` as the id of a stored adapter the caller may read: 400 if it is no valid id,
    404 naming ``lora_path`` if no such adapter is stored (or readable)."""
    try:
        adapter_id = validate_adapter_id(lora_path, "lora_path")
    except InvalidRequestError as exc:
        reason = str(exc).removeprefix("lora_path: ").removeprefix(f"{lora_path!r}: ")
        raise InvalidRequestError(f"must be {_FORMS}; {lora_path!r} is neither an absolute path nor an id "
                                  f"({reason})", "lora_path") from None
    try:
        if not may_read(adapter_id, adapters.get(adapter_id).public):
            raise AdapterNotFoundError(adapter_id)
    except AdapterNotFoundError:
        raise HttpError(404, f"lora_path: no stored adapter {adapter_id!r} exists; lora_path must be {_FORMS} (a "
                             "folder as an absolute path: a relative one is never looked up in the server's working "
                             "directory)", param="lora_path", code="model_not_found") from None
    return adapter_id


def _check_may_read(allowed: bool, lora_path: str) -> None:
    if not allowed:
        raise PermissionDeniedError(f"lora_path: only an admin may load from the server's folders or buckets "
                                    f"({lora_path!r}); load a stored adapter id instead")


def _checked_size(sizes: dict[str, int], max_bytes: int, where: str) -> None:
    total = sum(sizes.values())
    if total > max_bytes:
        raise InvalidRequestError(f"the adapter in {where} has {total} bytes, above this server's upload limit of "
                                  f"{max_bytes}", "lora_path")


def _folder_files(folder: Path, max_bytes: int) -> dict[str, bytes]:
    if not folder.is_dir():
        raise InvalidRequestError(f"{str(folder)!r} is not a folder on the server", "lora_path")
    missing = [name for name in PEFT_FILES if not (folder / name).is_file()]
    if missing:
        raise InvalidRequestError(f"{str(folder)!r} has no {', '.join(missing)} (a PEFT LoRA folder)", "lora_path")
    _checked_size({name: (folder / name).stat().st_size for name in PEFT_FILES}, max_bytes, str(folder))
    return {name: (folder / name).read_bytes() for name in PEFT_FILES}
