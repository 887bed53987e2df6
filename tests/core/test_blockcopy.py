"""kvbridge.blockcopy: the C extension and its Python twin give the same copies and the same
checksums as the definition spelled out with xxhash (each part's xxh3-64, combined), refuse
addresses outside their planes, and a whole fetch works with the extension switched off."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from kvbridge import KVPool, blockcopy
from kvbridge.blockcopy import planes, py_copy_blocks, py_gather_blocks, py_hash_blocks, py_scatter_blocks
from kvbridge.integrity import block_checksums, layer_checksums

from ._pools import LAYOUTS, checksum_of, filled

pytestmark = pytest.mark.timeout(60)


def _by_hand(pool: KVPool, ids: list[int], layers: range) -> list[int]:
    """The checksum's definition, spelled out: each part's xxh3-64 in (layer, part) order, combined."""
    L = pool.layout
    out = []
    for b in ids:
        parts = []
        for layer in layers:
            for part in range(L.num_parts):
                buf, off, n = L.segment(layer, b, part, pool.num_blocks)
                parts.append(pool.host_views()[buf][off:off + n])
        out.append(checksum_of(parts))
    return out


def test_the_extension_is_built():
    if os.environ.get("KVBRIDGE_NO_NATIVE"):
        pytest.skip("KVBRIDGE_NO_NATIVE is set: the Python twin runs on purpose")
    assert blockcopy.NATIVE, "kvbridge._kvcopy did not build: pip install -e . needs gcc and Python's headers"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_checksums_match_the_definition_in_c_and_python(name):
    pool = filled(LAYOUTS[name], 9, 1)
    L = pool.layout
    ids = [7, 0, 3, 8]
    want = _by_hand(pool, ids, range(L.num_layers))
    nplanes = L.num_layers * L.num_parts
    assert block_checksums(pool, ids) == want
    assert py_hash_blocks(planes(pool), ids, L.part_nbytes, nplanes) == want
    assert blockcopy.hash_blocks(planes(pool), ids, L.part_nbytes, nplanes) == want
    per_layer = [x for layer in range(L.num_layers) for x in _by_hand(pool, ids, range(layer, layer + 1))]
    assert layer_checksums(pool, ids, range(L.num_layers)) == per_layer
    assert py_hash_blocks(planes(pool), ids, L.part_nbytes, L.num_parts) == per_layer
    sub = range(1, L.num_layers)
    assert block_checksums(pool, ids, sub) == _by_hand(pool, ids, sub)


@pytest.mark.parametrize("impl", ["native", "python"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_copy_blocks_moves_the_bytes_and_hashes_what_landed(name, impl):
    if impl == "native" and not blockcopy.NATIVE:
        pytest.skip("the extension is not built")
    copy = blockcopy.copy_blocks if impl == "native" else py_copy_blocks
    layout = LAYOUTS[name]
    src, dst = filled(layout, 11, 2), filled(layout, 6, 3)      # different sizes: different strides
    rnd = random.Random(4)
    sid, did = rnd.sample(range(11), 5), rnd.sample(range(6), 5)
    digests = copy(planes(dst), did, planes(src), sid, layout.part_nbytes, True)
    assert digests == block_checksums(src, sid) == block_checksums(dst, did)
    untouched = [b for b in range(6) if b not in did][0]
    before = block_checksums(dst, [untouched])
    assert copy(planes(dst), did[:1], planes(src), sid[1:2], layout.part_nbytes, False) is None
    assert block_checksums(dst, did[:1]) == block_checksums(src, sid[1:2])
    assert block_checksums(dst, [untouched]) == before              # nothing else written


def _raw_planes(tensors: list[torch.Tensor], part: int, nblocks: int) -> bytes:
    """One plane per tensor, its blocks back to back (stride = part)."""
    return blockcopy.pack_planes([(t.data_ptr(), part, t.data_ptr() + nblocks * part) for t in tensors])


# parts around the stripe (64), the short-input limit (240) and the block (1,024) of xxh3, and
# odd sizes
PARTS = [1, 37, 63, 64, 65, 80, 100, 120, 239, 240, 241, 1000, 1024, 1025, 4096, 4097, 65536 + 7]


@pytest.mark.parametrize("part", PARTS)
def test_one_pass_copy_and_hash_equals_xxhash_for_every_shape(part):
    """Copies with a hash take one pass where ``_kvcopy.FUSED`` (each 64-byte stripe loaded once,
    stored and hashed): the checksum of every shape -- one to five parts, the last stripe
    overlapping, a block copied onto itself -- is the definition's (each part's xxhash xxh3_64,
    combined), and the bytes land; so do the chunked path (hash=2), which runs where FUSED is 0, and
    the AVX2 pass (hash=3), which runs where FUSED is 1 (hash=1 takes the AVX-512 one where FUSED is 2)."""
    if not blockcopy.NATIVE:
        pytest.skip("the extension is not built")
    rnd = random.Random(part)
    g = torch.Generator().manual_seed(part)
    for nplanes in (1, 2, 3, 5):
        srcs = [torch.randint(0, 256, (3 * part,), dtype=torch.uint8, generator=g) for _ in range(nplanes)]
        dsts = [torch.zeros(3 * part, dtype=torch.uint8) for _ in range(nplanes)]
        sp, dp = _raw_planes(srcs, part, 3), _raw_planes(dsts, part, 3)
        sid, did = rnd.sample(range(3), 2), rnd.sample(range(3), 2)
        for fn in ("copy", "copy chunked", "copy avx2", "scatter"):
            for t in dsts:
                t.zero_()
            if fn.startswith("copy"):       # hash=1: the fastest path here; 2: the chunked one; 3: AVX2's
                got = blockcopy.copy_blocks(dp, did, sp, sid, part, {"copy": 1, "copy chunked": 2, "copy avx2": 3}[fn])
            else:
                wire = b"".join(bytes(srcs[j][b * part:(b + 1) * part].numpy()) for j in range(nplanes) for b in sid)
                got = blockcopy.scatter_blocks(dp, did, bytearray(wire), 0, part, True)
            for k, (s_, d_) in enumerate(zip(sid, did)):
                parts = [bytes(t[s_ * part:(s_ + 1) * part].numpy()) for t in srcs]
                landed = b"".join(bytes(t[d_ * part:(d_ + 1) * part].numpy()) for t in dsts)
                assert landed == b"".join(parts), (fn, nplanes, k)
                assert got[k] == checksum_of(parts), (fn, nplanes, k)
        before = b"".join(bytes(t.numpy()) for t in srcs)
        got = blockcopy.copy_blocks(sp, [1, 0], sp, [1, 0], part, True)     # onto itself
        assert b"".join(bytes(t.numpy()) for t in srcs) == before
        assert got == [checksum_of(bytes(t[b * part:(b + 1) * part].numpy()) for t in srcs) for b in (1, 0)]


def test_one_pass_copy_is_taken_where_the_cpu_allows():
    """The one-pass kernel is what runs on x86-64 with AVX2, in one 512-bit register per stripe
    where the CPU has AVX-512F (this test then fails if it is not built in); elsewhere the
    chunked path is the documented one."""
    if not blockcopy.NATIVE:
        pytest.skip("the extension is not built")
    from kvbridge import _kvcopy
    import platform
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    if platform.machine().lower() not in ("x86_64", "amd64") or "avx2" not in flags:
        assert _kvcopy.FUSED == 0
        pytest.skip("no AVX2 here: copies with a hash take the chunked path")
    assert _kvcopy.FUSED == (2 if "avx512f" in flags else 1)


def test_one_pass_copy_of_parts_that_partly_overlap_takes_the_chunked_path():
    """A block whose part partly overlaps its source (possible only with hand-made planes) is
    copied as memmove does and hashed as landed, never by the stripe loop's load-then-store."""
    if not blockcopy.NATIVE:
        pytest.skip("the extension is not built")
    part = 4096
    buf = torch.randint(0, 256, (3 * part,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    want = bytes(buf[100:100 + part].numpy())
    base = buf.data_ptr()
    src = blockcopy.pack_planes([(base + 100, part, base + 3 * part)])
    dst = blockcopy.pack_planes([(base, part, base + 3 * part)])
    got = blockcopy.copy_blocks(dst, [0], src, [0], part, True)
    assert bytes(buf[:part].numpy()) == want
    assert got == [checksum_of([want])]


@pytest.fixture
def streaming():
    """Every copy streams past the caches (``_kvcopy.stream_from(1)``); the default after."""
    if not blockcopy.NATIVE:
        pytest.skip("the extension is not built")
    from kvbridge import _kvcopy
    _kvcopy.stream_from(1)
    try:
        yield _kvcopy
    finally:
        _kvcopy.stream_from(0)


@pytest.mark.parametrize("part", [37, 64, 255, 256, 300, 4096, 4097, 65536 + 7])
def test_streamed_copies_land_the_same_bytes_and_digests(streaming, part):
    """Copies at or above ``stream_from`` store past the caches: every shape -- parts under and
    over a stripe, destinations off a 32- and 64-byte boundary (their head and tail stored the
    usual way), a block copied onto itself, parts that partly overlap their source -- lands the
    same bytes and the same checksums as the definition, hashed (one pass: hash=1 and 3) and not."""
    g = torch.Generator().manual_seed(part)
    rnd = random.Random(part)
    for nplanes in (1, 3):
        for skew in (0, 1, 33):
            srcs = [torch.randint(0, 256, (3 * part + 64,), dtype=torch.uint8, generator=g) for _ in range(nplanes)]
            dsts = [torch.zeros(3 * part + 64, dtype=torch.uint8) for _ in range(nplanes)]
            sp = blockcopy.pack_planes([(t.data_ptr() + 5, part, t.data_ptr() + 5 + 3 * part) for t in srcs])
            dp = blockcopy.pack_planes([(t.data_ptr() + skew, part, t.data_ptr() + skew + 3 * part) for t in dsts])
            sid, did = rnd.sample(range(3), 3), rnd.sample(range(3), 3)
            for mode in (0, 1, 3):
                for t in dsts:
                    t.zero_()
                got = blockcopy.copy_blocks(dp, did, sp, sid, part, mode)
                for k, (s_, d_) in enumerate(zip(sid, did)):
                    parts = [bytes(t[5 + s_ * part:5 + (s_ + 1) * part].numpy()) for t in srcs]
                    landed = b"".join(bytes(t[skew + d_ * part:skew + (d_ + 1) * part].numpy()) for t in dsts)
                    assert landed == b"".join(parts), (nplanes, skew, mode, k)
                    if mode:
                        assert got[k] == checksum_of(parts), (nplanes, skew, mode, k)
                for t in dsts:      # the bytes around the blocks were never written
                    assert not t[:skew].any() and not t[skew + 3 * part:].any(), (nplanes, skew, mode)
    buf = torch.randint(0, 256, (3 * part,), dtype=torch.uint8, generator=g)
    before = bytes(buf.numpy())
    one = blockcopy.pack_planes([(buf.data_ptr(), part, buf.data_ptr() + 3 * part)])
    for mode in (0, 1):
        blockcopy.copy_blocks(one, [2, 0], one, [2, 0], part, mode)     # onto itself
        assert bytes(buf.numpy()) == before
    if part >= 64:                  # a part that partly overlaps its source: as memmove lands it
        src = blockcopy.pack_planes([(buf.data_ptr() + 40, part, buf.data_ptr() + 3 * part)])
        want = bytes(buf[40:40 + part].numpy())
        blockcopy.copy_blocks(one, [0], src, [0], part, 0)
        assert bytes(buf[:part].numpy()) == want


def test_copies_stream_from_four_times_the_l2_or_the_setting(tmp_path):
    """The default threshold is four times this core's L2 (4 MiB where sysconf does not know
    it); ``KVBRIDGE_STREAM_FROM`` sets it, and a value that is not a positive integer is ignored."""
    if not blockcopy.NATIVE:
        pytest.skip("the extension is not built")
    try:    # Python's os.sysconf does not name it; glibc's getconf does
        l2 = int(subprocess.run(["getconf", "LEVEL2_CACHE_SIZE"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or 0)
    except (OSError, ValueError):
        pytest.skip("getconf LEVEL2_CACHE_SIZE does not answer here")
    want = 4 * l2 if l2 > 0 else 4 << 20
    code = "from kvbridge import _kvcopy; print(_kvcopy.stream_from())"
    for env, expect in ((None, want), ("12345", 12345), ("-5", want), ("lots", want), ("0", want)):
        e = {k: v for k, v in os.environ.items() if k != "KVBRIDGE_STREAM_FROM"}
        if env is not None:
            e["KVBRIDGE_STREAM_FROM"] = env
        out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert int(out.stdout) == expect, env


@pytest.mark.parametrize("impl", ["native", "python"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gather_and_scatter_are_the_wire_order_of_the_segments(name, impl):
    """gather_blocks lays blocks out exactly as the segments of Spans.of_blocks (the tcp wire
    order), between head and tail bytes; scatter_blocks puts them back, hashing what landed."""
    if impl == "native" and not blockcopy.NATIVE:
        pytest.skip("the extension is not built")
    gather = blockcopy.gather_blocks if impl == "native" else py_gather_blocks
    scatter = blockcopy.scatter_blocks if impl == "native" else py_scatter_blocks
    from kvbridge.transports.base import Spans
    layout = LAYOUTS[name]
    src, dst = filled(layout, 11, 7), filled(layout, 6, 8)
    sid, did = [9, 2, 3, 0], [5, 1, 0, 4]
    p = layout.part_nbytes
    wire = bytes(b"".join(bytes(v) for v in Spans.of_blocks(src, sid).views()))
    got = gather(planes(src), sid, p, 7, 4)
    assert isinstance(got, bytearray) and bytes(got) == bytes(7) + wire + bytes(4)
    untouched = block_checksums(dst, [2, 3])
    digests = scatter(planes(dst), did, got, 7, p, True)
    assert digests == block_checksums(src, sid) == block_checksums(dst, did)
    assert block_checksums(dst, [2, 3]) == untouched                # nothing else written
    assert scatter(planes(dst), did[:1], memoryview(wire), 0, p, False) is None
    with pytest.raises(ValueError):                                 # the source is too short
        scatter(planes(dst), did, got, 12, p, True)
    with pytest.raises(ValueError):
        scatter(planes(dst), did, got, -1, p, True)
    with pytest.raises(ValueError):
        scatter(planes(dst), [6], got, 0, p, True)                  # outside the pool
    with pytest.raises(ValueError):
        gather(planes(src), [11], p, 0, 0)
    with pytest.raises(ValueError):
        gather(planes(src), [0], p, -1, 0)
    assert block_checksums(dst, [2, 3]) == untouched


@pytest.mark.parametrize("impl", ["native", "python"])
def test_addresses_outside_a_plane_are_refused_before_any_copy(impl):
    if impl == "native" and not blockcopy.NATIVE:
        pytest.skip("the extension is not built")
    copy = blockcopy.copy_blocks if impl == "native" else py_copy_blocks
    hsh = blockcopy.hash_blocks if impl == "native" else py_hash_blocks
    layout = LAYOUTS["kv_first"]
    src, dst = filled(layout, 4, 5), filled(layout, 4, 6)
    before = block_checksums(dst, range(4))
    p = layout.part_nbytes
    n = layout.num_layers * layout.num_parts
    for sid, did in (([0, 4], [0, 1]), ([0, 1], [0, -1]), ([0, 1], [2, 1 << 40])):
        with pytest.raises(ValueError):
            copy(planes(dst), did, planes(src), sid, p, True)
    with pytest.raises(ValueError):
        copy(planes(dst), [0, 1], planes(src), [0], p, True)
    with pytest.raises(ValueError):
        hsh(planes(src), [4], p, n)
    with pytest.raises(ValueError):
        hsh(planes(src), [0], p + 1 << 20, n)         # a part longer than the buffer
    with pytest.raises(ValueError):
        hsh(planes(src), [0], p, n + 1)               # groups must divide the planes
    assert block_checksums(dst, range(4)) == before


def test_a_fetch_without_the_extension(tmp_path):
    """The Python twin end to end: shm one-sided and tcp reads, verified, in a fresh process."""
    code = textwrap.dedent("""
        import torch
        from kvbridge import KVLayout, KVPool, KVReceiver, KVSender, blockcopy
        assert not blockcopy.NATIVE
        L = KVLayout(2, 1, 64, 4, "float16", "kv_first", "NHD", 0, 1)
        for url in ("shm://", "tcp://127.0.0.1:0"):
            src = KVPool.allocate(L, 4, shared=url.startswith("shm"), allocator="engine")
            src.buffers[0].view(-1).view(torch.uint8)[:] = 7
            dst = KVPool.allocate(L, 4, allocator="engine")
            with KVSender(src, url, leases=False) as s, KVReceiver(dst, leases=False) as r:
                res = r.fetch(s.publish("r", [1, 2], 8), [3, 0])
                assert res.ok, res.error
                assert bool((dst.buffers[0][:, 3] == src.buffers[0][:, 1]).all())
        print("ok")
    """)
    env = dict(os.environ, KVBRIDGE_NO_NATIVE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_closed_pool_is_refused_never_touched():
    """The C pass takes raw addresses: a pool closed after its planes were cached must be
    refused, not read or written (its memory may be gone)."""
    from kvbridge import KVReceiver, KVSender, PoolError
    layout = LAYOUTS["kv_first"]
    pool = filled(layout, 4, 7)
    block_checksums(pool, [0, 1])                     # planes cached
    pool.close()
    with pytest.raises(PoolError):
        block_checksums(pool, [0])
    src = KVPool.allocate(layout, 4, shared=True, allocator="engine")
    dst = KVPool.allocate(layout, 4, allocator="engine")
    with KVSender(src, "shm://", leases=False) as snd, KVReceiver(dst, leases=False) as rcv:
        assert rcv.fetch(snd.publish("a", [0], 4), [1]).ok   # the one-sided path and dst's planes cached
        dst.close()
        res = rcv.fetch(snd.publish("b", [1], 4), [2])
        assert not res.ok and isinstance(res.error, PoolError), res.error


def test_a_sender_announcing_another_geometry_never_spills_into_other_blocks():
    """The C pass trusts the part size: a one-sided read whose sender announced another
    geometry (a hostile OPEN reply) must not take it -- the read is refused before a byte is
    written, and no other block changes."""
    from kvbridge import KVReceiver, KVSender, ProtocolError
    layout = LAYOUTS["kv_first"]
    src = filled(layout, 4, 8)
    shared = KVPool.allocate(layout, 4, shared=True, allocator="engine")
    for a, b in zip(shared.buffers, src.buffers):
        a.copy_(b)
    dst = filled(layout, 4, 9)
    neighbours = block_checksums(dst, [0, 2, 3])
    with KVSender(shared, "shm://", leases=False) as snd, KVReceiver(dst, leases=False) as rcv:
        h = snd.publish("a", [0], 4)
        url = snd.urls[0]
        tr = rcv.transport(url)
        m = tr._sender(url, h, None)                     # as if OPEN had announced twice the head_dim
        import dataclasses
        m.layout = dataclasses.replace(m.layout, head_dim=2 * m.layout.head_dim)
        m.part = m.layout.part_nbytes
        before = block_checksums(dst, [1])
        res = rcv.fetch(h, [1])
        assert not res.ok and isinstance(res.error, ProtocolError), res.error
    assert block_checksums(dst, [1]) == before
    assert block_checksums(dst, [0, 2, 3]) == neighbours
