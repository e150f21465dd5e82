"""The one upload assembler (adapter_store/assembly.py) both upload streams use: named chunks
(the server's UploadAdapter) and back-to-back bytes (the store's Put) give the same files and
digests; every fault is caught where it happens and names its file. Its relay (the server passing
an upload on to the store) gives the same bytes back to back, holding only what came early."""

from __future__ import annotations

import hashlib

import pytest

from loraplex.adapter_store.assembly import Assembly, AssemblyError, DeclaredFile, Fault, Relay

FILES = {"adapter_config.json": b'{"r": 8}', "empty.txt": b"", "adapter_model.safetensors": bytes(range(256)) * 9}


def _declared(sha: bool = True) -> list[DeclaredFile]:
    return [DeclaredFile(n, len(b), hashlib.sha256(b).hexdigest() if sha else "") for n, b in FILES.items()]


def test_named_chunks_and_back_to_back_bytes_assemble_the_same_files() -> None:
    named, in_order = Assembly(_declared()), Assembly(_declared(sha=False))
    for name, data in reversed(FILES.items()):  # named chunks may come in any order
        for i in range(0, len(data), 100):
            named.add(data[i : i + 100], name)
    stream = b"".join(FILES.values())
    for i in range(0, len(stream), 77):  # chunks that straddle files, and skip the empty one
        in_order.add(stream[i : i + 77])
    assert named.complete and in_order.complete and named.received == in_order.received == len(stream)
    assert named.finish() == in_order.finish() == (FILES, {n: hashlib.sha256(b).hexdigest() for n, b in FILES.items()})


@pytest.mark.parametrize("feed, fault, name", [
    (lambda a: a.add(b"x", "other.bin"), Fault.UNDECLARED, "other.bin"),
    (lambda a: a.add(b"x" * 9, "adapter_config.json"), Fault.OVERLONG, "adapter_config.json"),
    (lambda a: a.add(b"".join(FILES.values()) + b"!"), Fault.OVERLONG, None),
])
def test_more_than_was_declared_is_refused_as_it_arrives(feed, fault: Fault, name: str | None) -> None:
    assembly = Assembly(_declared())
    with pytest.raises(AssemblyError) as refused:
        feed(assembly)
    assert (refused.value.fault, refused.value.name) == (fault, name)
    assert assembly.received == 0  # nothing of the refused chunk was taken


def test_a_short_file_or_a_wrong_digest_fails_at_finish_naming_the_file() -> None:
    short = Assembly(_declared())
    short.add(FILES["adapter_config.json"], "adapter_config.json")
    short.add(FILES["adapter_model.safetensors"][:10], "adapter_model.safetensors")
    assert not short.complete
    with pytest.raises(AssemblyError) as refused:
        short.finish()
    assert (refused.value.fault, refused.value.name, refused.value.got) == (Fault.TRUNCATED, "adapter_model.safetensors", 10)
    wrong = Assembly([DeclaredFile("a", 2, hashlib.sha256(b"xy").hexdigest())])
    wrong.add(b"yx", "a")
    with pytest.raises(AssemblyError) as refused:
        wrong.finish()
    assert (refused.value.fault, refused.value.name) == (Fault.DIGEST, "a")


def _relayed(relay: Relay, chunks: list[tuple[str, bytes]]) -> list[bytes]:
    passed: list[bytes] = []
    for name, data in chunks:
        passed.append(b"".join(relay.add(data, name)))
    return passed


def test_a_relay_passes_the_files_on_back_to_back_in_declared_order() -> None:
    in_order = [(n, b[i : i + 100]) for n, b in FILES.items() for i in range(0, len(b), 100)]
    relay = Relay(_declared())
    passed = _relayed(relay, in_order)
    assert passed == [data for _, data in in_order]  # a sender in declared order: each chunk goes on at once
    assert relay.complete and relay.finish() == {n: hashlib.sha256(b).hexdigest() for n, b in FILES.items()}
    reordered = Relay(_declared())
    last_first = sorted(in_order, key=lambda chunk: chunk[0] != "adapter_model.safetensors")
    passed = _relayed(reordered, last_first)  # the last file first: it waits for the first
    assert passed[: len(in_order) - 1] == [b""] * (len(in_order) - 1)
    assert passed[-1] == b"".join(FILES.values())
    assert reordered.finish() == relay.finish()


def test_a_relay_refuses_as_the_assembler_does() -> None:
    relay = Relay(_declared())
    for feed, fault in [(lambda: relay.add(b"x", "other.bin"), Fault.UNDECLARED),
                        (lambda: relay.add(b"x" * 9, "adapter_config.json"), Fault.OVERLONG)]:
        with pytest.raises(AssemblyError) as refused:
            feed()
        assert refused.value.fault is fault
    assert relay.received == 0
    relay.add(FILES["adapter_config.json"], "adapter_config.json")
    with pytest.raises(AssemblyError) as refused:
        relay.finish()
    assert (refused.value.fault, refused.value.name) == (Fault.TRUNCATED, "adapter_model.safetensors")
    wrong = Relay([DeclaredFile("a", 2, hashlib.sha256(b"xy").hexdigest())])
    assert wrong.add(b"yx", "a") == [b"yx"]
    with pytest.raises(AssemblyError) as refused:
        wrong.finish()
    assert (refused.value.fault, refused.value.name) == (Fault.DIGEST, "a")
