"""Twin KV server: LRU store, raw ZMQ frames like LMCache's, and the HTTP monitoring surface."""
import msgpack
import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from appliance.twin.kvstore import ChunkStore


def test_lru_evicts_least_recently_used_over_the_byte_budget():
    s = ChunkStore(300)
    s.store([("a", 10, 100), ("b", 10, 100), ("c", 10, 100)])
    assert s.lookup(["a"], [10]) == 10           # touch a: b is now the oldest
    s.store([("d", 10, 100)])
    assert s.peek(["b"]) == 0 and s.peek(["a"]) == 10 and s.peek(["d"]) == 10
    assert s.c.evicted_chunks == 1 and s.used == 300


def test_lookup_counts_only_the_contiguous_prefix():
    s = ChunkStore(10_000)
    s.store([("a", 256, 1), ("c", 256, 1)])
    assert s.lookup(["a", "b", "c"], [256, 256, 100]) == 256
    assert s.c.lookup_requested_tokens == 612 and s.c.lookup_hit_tokens == 256


def test_bad_size_is_an_error():
    with pytest.raises(ValueError, match="> 0"):
        ChunkStore(0)


def rpc(sock, uid, op, *payload):
    sock.send_multipart([msgpack.packb(uid), msgpack.packb(op)] + [msgpack.packb(p) for p in payload])
    assert sock.poll(5000), "no answer from the twin KV server"
    return [msgpack.unpackb(f, raw=False) for f in sock.recv_multipart()]


def metric_values(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_raw_zmq_and_http_surface(procs):
    zp, hp = procs.kvserver()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{zp}")
    try:
        assert rpc(sock, 1, 22, None) == [1, 22, True]            # ping, as a monitor sends it
        assert rpc(sock, 2, 24) == [2, 24, "OK"]                  # noop
        assert rpc(sock, 3, 21) == [3, 21, 256]                   # get_chunk_size
        assert rpc(sock, 4, "twin_store", "m", [["h1", 256, 1000], ["h2", 100, 400]]) == [4, "twin_store", 2]
        assert rpc(sock, 5, "twin_lookup", "m", [["h1", 256], ["h2", 100], ["h3", 50]])[2] == 356
        assert "error" in rpc(sock, 6, "no_such_op")[2]
    finally:
        sock.close(0)
    base = f"http://127.0.0.1:{hp}"
    assert httpx.get(base + "/healthcheck").json() == {"status": "healthy"}
    st = httpx.get(base + "/status").json()
    l1 = st["storage_manager"]["l1_manager"]
    assert st["chunk_size"] == 256 and l1["total_object_count"] == 2 and l1["memory_used_bytes"] == 1400
    m = metric_values(httpx.get(base + "/metrics").text)
    assert m["lmcache_mp_lookup_requested_tokens_total"] == 406
    assert m["lmcache_mp_lookup_hit_tokens_total"] == 356
    assert m["lmcache_mp_l1_write_chunks_total"] == 2
    assert m["lmcache_mp_l1_memory_usage_bytes"] == 1400
    assert 0 < m["lmcache_mp_l1_usage_ratio"] < 1
    assert "lmcache_mp_l1_evicted_chunks_total" in m
