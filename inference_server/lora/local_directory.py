"""The embedded default adapter source: PEFT folders in a local directory.

The engine asks an ``AdapterSource`` (adapter_store/format/files.py) to resolve an adapter id
to its files; the adapter store's client implements the same interface (adapter_store/client.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

from loraplex.adapter_store.errors import AdapterNotFoundError, AdapterValidationError, InvalidRequestError
from loraplex.adapter_store.format.base_shapes import BaseShapes
from loraplex.adapter_store.format.files import ADAPTER_FILES, AdapterFiles, AdapterInfo, content_version, make_info
from loraplex.adapter_store.format.naming import validate_adapter_id
from loraplex.adapter_store.format.pattern_decisions import PatternValue
from loraplex.adapter_store.format.peft_format import CONFIG_FILE, parse_adapter_files, parse_adapter_upload
from loraplex.inference_server.lora.retired_versions import RetiredVersions, remove_leftovers

log = logging.getLogger(__name__)

# Written next to the PEFT files of a LocalAdapterDirectory version: {"public": true|false}.
VISIBILITY_FILE = "loraplex_visibility.json"
# And what the config's patterns decided at upload ({"pattern_values": [...]}), so reading the
# version matches no pattern again (a hand-made folder has none: its patterns are judged).
PATTERNS_FILE = "loraplex_patterns.json"
# And the version's AdapterInfo as put computed it (hash, rank, ...), with the sizes of its files and
# what it was checked against (the base shapes and rank cap), so that Get and List of a managed
# version read this instead of reading and hashing its weights (a fresh server listing thousands
# of adapters would read them all). A version folder is never written after its rename; where the
# sizes or the checks differ, or the file is unreadable, the adapter is read and hashed as before.
INFO_FILE = "loraplex_info.json"
# What PEFT's save_pretrained writes (its model card beside the adapter's files): a hand-made folder
# holding only these is replaced or deleted whole; anything else in it refuses the call.
PEFT_SAVED_FILES = frozenset({*ADAPTER_FILES, "README.md"})

class LocalAdapterDirectory:
    """Adapters as PEFT folders under ``root/<id>`` (``id`` = ``name`` or ``tenant/name``).

    ``root/<id>`` is either a plain folder (put there by hand) or a symlink to an
    immutable version folder under ``root/.versions``; ``put`` writes and validates a new
    version there, then swaps the symlink with one atomic rename, so a reader sees the old
    version or the new, never a mix, and a failed upload leaves nothing behind. A version
    folder also holds ``loraplex_visibility.json`` (``{"public": true}``), published by the
    same rename; a folder without it (made by hand) is private.

    A one-part id names either an adapter or a tenant folder (``root/<tenant>/<name>``), never
    both: an upload that would make one into the other, which would remove or hide the adapters
    already there, is refused, and a tenant folder is not an adapter to delete.

    Nothing the server did not write is deleted: a symlink made by hand is replaced or removed,
    never what it points to; a hand-made folder is replaced or deleted only while it holds nothing
    but what PEFT's save_pretrained writes (anything else there, a training log or checkpoints,
    refuses the call by name). A replaced or deleted version's folder stays a while, so a reader that
    pinned it reads it whole, and leftovers of a process killed mid-write (staging, unlinked versions)
    go at start (lora/retired_versions.py).
    """

    def __init__(self, root: str | os.PathLike[str], base: BaseShapes | None = None, max_rank: int = 128) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._versions = self.root / ".versions"
        self._staging = self.root / ".staging"
        self._base = base
        self._max_rank = max_rank
        self._lock = threading.Lock()
        # id -> (what its files were when read, its info): get and list read and hash every
        # weights file only when it changed (else every ListAdapters re-reads them all, linear in the adapters)
        self._infos: dict[str, tuple[tuple, AdapterInfo]] = {}
        self._skipped: dict[str, str] = {}  # folder -> why list() leaves it out (logged once a reason)
        self._retired = RetiredVersions()  # version folders no link names any more
        self._remove_leftovers()

    def _path(self, adapter_id: str) -> Path:
        """Where ``adapter_id`` lives; inside another adapter (``a/b`` where ``a`` is an adapter) none."""
        path = self.root / validate_adapter_id(adapter_id)
        if "/" in adapter_id and _is_adapter(path.parent):
            raise AdapterNotFoundError(adapter_id)
        return path

    def _check_no_clash(self, adapter_id: str, target: Path) -> None:
        """Refuse an upload that would turn a tenant folder into an adapter or write an adapter
        inside another one (call under the lock)."""
        if "/" in adapter_id:
            tenant = adapter_id.split("/")[0]
            if _is_adapter(self.root / tenant):
                raise InvalidRequestError(
                    f"{adapter_id!r}: {tenant!r} is an adapter, so it cannot also be a tenant holding adapters",
                    "adapter_id")
        elif target.is_dir() and not target.is_symlink():
            held = _held_adapters(target)
            if held:
                raise InvalidRequestError(
                    f"{adapter_id!r} is a tenant holding adapters ({', '.join(held[:3])}"
                    f"{', ...' if len(held) > 3 else ''}), so it cannot also be an adapter", "adapter_id")
            if not (target / CONFIG_FILE).exists() and any(target.iterdir()):
                raise InvalidRequestError(
                    f"{adapter_id!r}: {target} exists and holds no adapter; move it away first", "adapter_id")
            self._check_only_adapter_files(adapter_id, target, "replace")

    @staticmethod
    def _check_only_adapter_files(adapter_id: str, folder: Path, what: str) -> None:
        """Refuse to remove a hand-made folder that holds more than what PEFT's save_pretrained writes."""
        others = sorted(p.name for p in folder.iterdir() if p.name not in PEFT_SAVED_FILES)
        if others:
            listed = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
            raise InvalidRequestError(
                f"{adapter_id!r} is a folder made by hand at {folder} that also holds {listed}; this server does not "
                f"{what} files it did not write: move them (or the folder) away first", "adapter_id")

    def _read(self, adapter_id: str) -> tuple[dict[str, bytes], float, bool, tuple[PatternValue, ...] | None]:
        pinned = _resolved(self._path(adapter_id))  # pin one version for its files, flag and decisions
        if pinned is None:
            raise AdapterNotFoundError(adapter_id)
        real = Path(pinned)
        try:
            files = {name: (real / name).read_bytes() for name in ADAPTER_FILES}
            return (files, real.stat().st_mtime, _read_public(adapter_id, real / VISIBILITY_FILE),
                    _read_decided(adapter_id, real / PATTERNS_FILE))
        except FileNotFoundError:  # judged on the pinned folder, not on what the link names by now
            if real.is_dir() and any((real / n).exists() for n in ADAPTER_FILES):
                raise AdapterValidationError(f"adapter {adapter_id!r} is incomplete on disk") from None
            raise AdapterNotFoundError(adapter_id) from None

    def resolve(self, adapter_id: str) -> AdapterFiles:
        """The adapter's files as stored here, parsed against the base; files that do not parse (put
        here by hand, damaged) are refused naming the adapter: the caller only named it."""
        files, mtime, public, decided = self._read(adapter_id)
        try:
            spec = parse_adapter_files(files, self._base, self._max_rank, decided)
        except AdapterValidationError as e:
            raise AdapterValidationError(f"adapter {adapter_id!r} as stored on this server cannot be served: {e}"
                                         ) from None
        return AdapterFiles(make_info(adapter_id, files, spec, mtime, public), spec, files)

    def get(self, adapter_id: str) -> AdapterInfo:
        key = _files_key(self._path(adapter_id))
        hit = self._infos.get(adapter_id)
        if key is not None and hit is not None and hit[0] == key:
            return hit[1]
        info = self._recorded_info(adapter_id, Path(key[0])) if key is not None else None
        if info is None:
            info = self.resolve(adapter_id).info
        if key is not None:
            self._infos[adapter_id] = (key, info)
        return info

    def _checks(self) -> dict:
        """What a recorded info was validated against: this directory's base shapes and rank cap."""
        shapes = None
        if self._base is not None:
            shapes = [self._base.num_layers, sorted([k, list(v)] for k, v in self._base.projection_shapes().items())]
        return {"base": shapes, "max_rank": self._max_rank}

    def _info_record(self, info: AdapterInfo, files: Mapping[str, bytes]) -> dict:
        record = asdict(info)
        del record["adapter_id"], record["public"]  # the id is the link's name; the flag has its own file
        record["file_sizes"] = {name: len(files[name]) for name in ADAPTER_FILES}
        record["checked"] = self._checks()
        return record

    def _recorded_info(self, adapter_id: str, real: Path) -> AdapterInfo | None:
        """The info the managed version at ``real`` (the folder ``adapter_id`` resolves to)
        recorded at put, where it still describes its files and was checked as this directory
        checks; else None (the caller reads the files). A hand-made folder is not under .versions."""
        if real.parent != Path(os.path.realpath(self._versions)):
            return None
        try:
            record = json.loads((real / INFO_FILE).read_bytes())
            sizes = record.pop("file_sizes")
            if record.pop("checked") != self._checks():
                return None
            if any((real / name).stat().st_size != sizes[name] for name in ADAPTER_FILES):
                return None
            decided = record.pop("pattern_values")
            return AdapterInfo(
                adapter_id=adapter_id, public=_read_public(adapter_id, real / VISIBILITY_FILE),
                target_modules=tuple(record.pop("target_modules")),
                pattern_values=None if decided is None else tuple(PatternValue.from_dict(v) for v in decided),
                **record)
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None

    def list(self) -> list[AdapterInfo]:
        with self._lock:  # a burst of uploads followed by none leaves no folder past its time
            self._retired.sweep()
        out = []
        # ids are name or tenant/name; "**" would not descend into the symlinked version folders
        for config in sorted([*self.root.glob(f"*/{CONFIG_FILE}"), *self.root.glob(f"*/*/{CONFIG_FILE}")]):
            rel = config.parent.relative_to(self.root).as_posix()
            if rel.startswith(".") or "/." in rel:
                continue
            try:
                out.append(self.get(rel))
            except (AdapterNotFoundError, AdapterValidationError, ValueError) as e:
                self._note_skipped(rel, str(e))  # a half-copied or foreign folder is not listed
            else:
                self._skipped.pop(rel, None)
        return out

    def _note_skipped(self, rel: str, why: str) -> None:
        """Log, once for each reason, why a folder with an adapter config is not listed (a bad name,
        a rank past --max-lora-rank, a half-copied file): else it only goes missing."""
        if self._skipped.get(rel) != why:
            self._skipped[rel] = why
            log.warning("adapter folder %s is not listed: %s", self.root / rel, why)

    def put(self, adapter_id: str, files: Mapping[str, bytes], public: bool = False) -> AdapterInfo:
        target = self.root / validate_adapter_id(adapter_id)  # (its clashes are checked under the lock)
        spec = parse_adapter_upload(files, self._base, self._max_rank)
        version, _ = content_version(files)
        stage = self._staging / uuid.uuid4().hex
        stage.mkdir(parents=True)
        try:
            for name in ADAPTER_FILES:
                _write_synced(stage / name, files[name])
            _write_synced(stage / VISIBILITY_FILE, json.dumps({"public": bool(public)}).encode())
            decided = {"pattern_values": [asdict(v) for v in spec.pattern_values]}
            _write_synced(stage / PATTERNS_FILE, json.dumps(decided).encode())
            info = make_info(adapter_id, files, spec, time.time(), bool(public))
            _write_synced(stage / INFO_FILE, json.dumps(self._info_record(info, files)).encode())
            with self._lock:
                self._check_no_clash(adapter_id, target)
                final = self._versions / f"{adapter_id.replace('/', '__')}@{version}-{uuid.uuid4().hex[:8]}"
                final.parent.mkdir(parents=True, exist_ok=True)
                stage.rename(final)
                self._swap_link(target, final)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        return info

    def _swap_link(self, target: Path, version_dir: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        old = self._managed_version(target)
        if target.exists() and not target.is_symlink():
            shutil.rmtree(target)  # a hand-made folder of PEFT files alone (checked) becomes managed
        link = target.parent / f".link-{uuid.uuid4().hex}"
        link.symlink_to(os.path.relpath(version_dir, target.parent))
        os.replace(link, target)
        if old is not None and old != version_dir:
            self._retired.retire(old)

    def delete(self, adapter_id: str) -> None:
        target = self._path(adapter_id)
        with self._lock:
            if not _is_adapter(target):  # nothing there, or a tenant folder
                raise AdapterNotFoundError(adapter_id)
            if target.is_symlink():  # the link goes; a version folder only if it is this server's
                old = self._managed_version(target)
                target.unlink()
                if old is not None:
                    self._retired.retire(old)
                return
            held = _held_adapters(target)
            if held:  # a hand-made adapter folder that also holds adapters: they would go with it
                raise InvalidRequestError(
                    f"{adapter_id!r}: its folder also holds the adapters {', '.join(held)}; delete them first",
                    "adapter_id")
            self._check_only_adapter_files(adapter_id, target, "delete")
            shutil.rmtree(target)

    def _managed_version(self, target: Path) -> Path | None:
        """The version folder under .versions a link at ``target`` names (None: no link, or one made
        by hand that points elsewhere: what it points to is not this server's to remove)."""
        if not target.is_symlink():
            return None
        real = Path(os.path.realpath(target))
        return real if real.parent == Path(os.path.realpath(self._versions)) else None

    def _remove_leftovers(self) -> None:
        remove_leftovers(self._staging, self._versions, _links(self.root))


def _files_key(folder: Path) -> tuple | None:
    """What identifies the adapter files at ``folder`` as read: the version folder it resolves to
    and each file's size and modification time (a hand-made folder edited in place changes them);
    None when they cannot be read (the caller reads them, and raises what that raises)."""
    real = _resolved(folder)
    if real is None:
        return None
    try:
        stats = [os.stat(os.path.join(real, name)) for name in ADAPTER_FILES]
    except OSError:
        return None
    try:
        flag = os.stat(os.path.join(real, VISIBILITY_FILE)).st_mtime_ns
    except OSError:
        flag = None
    return (real, flag, *((st.st_size, st.st_mtime_ns, st.st_ino) for st in stats))


def _resolved(folder: Path) -> str | None:
    """The folder ``folder`` names now (a link's version folder, or a hand-made folder itself), or
    None where nothing is there. Not a plain os.path.realpath: a delete landing between its lstat and
    its readlink of the link raised FileNotFoundError (an INTERNAL error for a request naming a deleted
    adapter), and a link absent when it looked came back unresolved, so the reads that followed went
    through whatever link an upload made meanwhile (a missing file there: 'incomplete on disk')."""
    try:
        return os.path.realpath(folder, strict=True)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _links(root: Path) -> list[Path]:
    """The symlinks where adapters live: ``root/<name>`` and ``root/<tenant>/<name>``."""
    found = []
    for path in root.iterdir():
        if path.name.startswith("."):
            continue
        if path.is_symlink():
            found.append(path)
        elif path.is_dir():
            found += [p for p in path.iterdir() if p.is_symlink()]
    return found


def _is_adapter(path: Path) -> bool:
    """An adapter lives at ``path``: a managed version link, or a hand-made folder with its config."""
    return path.is_symlink() or (path / CONFIG_FILE).is_file()


def _held_adapters(folder: Path) -> list[str]:
    """The ids of the adapters inside a (tenant) folder, sorted."""
    return sorted(f"{folder.name}/{p.name}" for p in folder.iterdir() if not p.name.startswith(".") and _is_adapter(p))


def _read_public(adapter_id: str, path: Path) -> bool:
    """The ``public`` flag of a version folder (False without the file, as for hand-made folders)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return False
    try:
        public = json.loads(raw).get("public")
    except (ValueError, AttributeError):
        public = None
    if not isinstance(public, bool):
        raise AdapterValidationError(
            f"adapter {adapter_id!r}: {path.name} must be {{\"public\": true|false}}; re-upload the adapter"
        )
    return public


def _read_decided(adapter_id: str, path: Path) -> tuple[PatternValue, ...] | None:
    """What a version's patterns were decided to be at upload (None without the file)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return tuple(PatternValue.from_dict(v) for v in json.loads(raw)["pattern_values"])
    except (ValueError, TypeError, KeyError, AttributeError):
        raise AdapterValidationError(
            f"adapter {adapter_id!r}: {path.name} must be {{\"pattern_values\": [...]}}; re-upload the adapter"
        ) from None


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
