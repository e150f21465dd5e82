"""Bad uploads get INVALID_ARGUMENT with a message naming the problem, and store nothing."""

from __future__ import annotations

import hashlib
import pickle

import grpc
import pytest
from store_adapters import CONFIG, WEIGHTS, peft_files, rewrite_tensors, with_config

from loraplex.v1 import store_pb2 as pb
from loraplex.v1 import store_pb2_grpc

pytestmark = pytest.mark.slow


def _put_raw(env, messages, raw: bool = False):
    """Send a Put stream as given (protobuf messages, or raw bytes when ``raw``); return the RpcError."""
    channel = grpc.insecure_channel(env.server.target)
    try:
        if raw:
            put = channel.stream_unary("/loraplex.v1.AdapterStore/Put", request_serializer=lambda b: b,
                                       response_deserializer=pb.StoredAdapter.FromString)
        else:
            put = store_pb2_grpc.AdapterStoreStub(channel).Put
        with pytest.raises(grpc.RpcError) as err:
            put(iter(messages), timeout=20)
        return err.value
    finally:
        channel.close()


def _meta(adapter_id, files, declared_sizes=None):
    return pb.StorePutRequest(metadata=pb.StorePutMetadata(adapter_id=adapter_id, files=[
        pb.StoredFile(name=n, size=(declared_sizes or {}).get(n, len(d))) for n, d in files.items()
    ]))


def _chunks(files):
    return [pb.StorePutRequest(chunk=d) for d in files.values()]


def _assert_nothing_stored(env):
    """Nothing stored, and the refusal counted once as an invalid upload (whether the stream or
    the folder in it was bad)."""
    assert env.store.metrics.value("loraplex_store_uploads_total", outcome="invalid") == 1
    assert env.client.list() == []
    assert env.stored_objects() == []
    assert env.redis_keys() == []


def _bad_files(name, adapters, foreign_adapters):
    good = adapters["r16-bf16"]
    cases = {
        "pickle": ({**peft_files(good), "adapter_model.bin": pickle.dumps({"x": 1})}, "pickle files are refused"),
        "missing-config": ({WEIGHTS: good[WEIGHTS]}, "missing adapter_config.json"),
        "zero-rank": (with_config(good, r=0), "r must be a positive integer"),
        "wrong-shapes": (
            rewrite_tensors(good, lambda t: {k: (v[:, :3] if "lora_B" in k and "q_proj" in k else v)
                                             for k, v in t.items()}),
            "does not match the declared rank",
        ),
        "unknown-target": (
            rewrite_tensors(good, lambda t: {k.replace("q_proj", "qq_proj"): v for k, v in t.items()}),
            "is not a LoRA A/B weight",
        ),
        "other-base-model": (foreign_adapters["r4-fp32"], "the base model's q_proj takes 64 inputs"),
        "dora": (with_config(good, use_dora=True), "DoRA"),
        "corrupt-json": ({**peft_files(good), CONFIG: b"{not json"}, "not valid JSON"),
        "traversal-file-name": ({**peft_files(good), "../adapter_config.json": b"{}"}, "plain file name"),
    }
    return cases[name]


@pytest.mark.parametrize("case", ["pickle", "missing-config", "zero-rank", "wrong-shapes", "unknown-target",
                                  "other-base-model", "dora", "corrupt-json", "traversal-file-name"])
def test_invalid_adapter_is_refused_and_nothing_is_stored(env, adapters, foreign_adapters, case):
    files, message = _bad_files(case, adapters, foreign_adapters)
    err = _put_raw(env, [_meta("acme/bad", files), *_chunks(files)])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.details()
    _assert_nothing_stored(env)


def test_truncated_stream_is_refused(env, adapters):
    files = peft_files(adapters["r16-bf16"])
    chunks = _chunks(files)
    chunks[-1] = pb.StorePutRequest(chunk=files[WEIGHTS][: len(files[WEIGHTS]) // 2])
    err = _put_raw(env, [_meta("acme/cut", files), *chunks])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "truncated upload" in err.details()
    _assert_nothing_stored(env)


def test_more_bytes_than_declared_is_refused(env, adapters):
    files = peft_files(adapters["r4-fp32"])
    err = _put_raw(env, [_meta("acme/long", files), *_chunks(files), pb.StorePutRequest(chunk=b"extra")])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "more bytes than" in err.details()
    _assert_nothing_stored(env)


def test_oversize_upload_is_refused_before_its_bytes_arrive(env, adapters):
    files = peft_files(adapters["r4-fp32"])
    huge = {WEIGHTS: 2 * env.store.max_adapter_bytes}
    err = _put_raw(env, [_meta("acme/huge", files, declared_sizes=huge)])  # no chunks sent at all
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "over the store's limit" in err.details()
    _assert_nothing_stored(env)


def test_declared_checksum_mismatch_is_refused(env, adapters):
    files = peft_files(adapters["r4-fp32"])
    meta = _meta("acme/sum", files)
    meta.metadata.files[1].sha256 = hashlib.sha256(b"something else").hexdigest()
    err = _put_raw(env, [meta, *_chunks(files)])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "do not match the declared sha256" in err.details()
    _assert_nothing_stored(env)


@pytest.mark.parametrize("adapter_id", ["../etc/passwd", "acme/../../x", "acme/..", "/abs", "a/b/c", "", "-x",
                                        "acme/" + "n" * 65, "acme/bad name", "acme/caf\u00e9"])
def test_bad_adapter_ids_are_refused(env, adapters, adapter_id):
    files = peft_files(adapters["r4-fp32"])
    err = _put_raw(env, [_meta(adapter_id, files), *_chunks(files)])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("adapter_id: ")
    assert ("loraplex-field", "adapter_id") in tuple(err.trailing_metadata())
    _assert_nothing_stored(env)


def test_non_utf8_adapter_id_is_invalid_argument(env, adapters):
    files = peft_files(adapters["r4-fp32"])
    raw = _meta("acme/PLACEHOLDER", files).SerializeToString().replace(b"PLACEHOLDER", b"\xff\xfe\xfdPLACEHO")
    err = _put_raw(env, [raw, *(c.SerializeToString() for c in _chunks(files))], raw=True)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "must be valid UTF-8" in err.details()
    _assert_nothing_stored(env)


def test_first_message_must_be_metadata(env, adapters):
    err = _put_raw(env, [pb.StorePutRequest(chunk=b"abc")])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "metadata" in err.details()
    _assert_nothing_stored(env)


def test_the_store_still_works_after_bad_uploads(env, adapters):
    _put_raw(env, [pb.StorePutRequest(chunk=b"abc")])
    assert env.client.put("acme/fine", adapters["r4-fp32"]).rank == 4
    assert [i.adapter_id for i in env.client.list()] == ["acme/fine"]
