"""Small-size transport benchmarks (pytest-benchmark). In the normal suite they run once
(``--benchmark-disable``) as plain tests: each asserts that the bytes arrived intact.

The full benchmark, with ceilings and ratios, is ``python -m bench.transport``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:          # `bench` is a top-level package of the repository
    sys.path.insert(0, str(ROOT))

torch = pytest.importorskip("torch")

from bench import transport as bt  # noqa: E402
from kvbridge.layout import KVLayout  # noqa: E402
from kvbridge.pool import KVPool  # noqa: E402
from kvbridge.receiver import KVReceiver  # noqa: E402
from kvbridge.transports.base import Spans  # noqa: E402

pytestmark = pytest.mark.timeout(60)
SEED = 1   # the seed Bench._setup asks the sender to fill its pool with


@pytest.fixture(scope="module")
def bench() -> Iterator[bt.Bench]:
    """One spawned sender process for the module (killed in teardown)."""
    b = bt.Bench(reps=1, quick=True)
    b.sender = bt.SenderProc()
    try:
        yield b
    finally:
        b.sender.close()
        b.sender = None


def expected_pool(case: bt.Case) -> KVPool:
    """What the sender's pool holds: same layout, same deterministic fill."""
    pool = KVPool.allocate(KVLayout.from_dict(case.layout), case.pool_blocks)
    bt.fill_pool(pool, SEED)
    return pool


def assert_blocks_equal(got: KVPool, want: KVPool, case: bt.Case) -> None:
    for layer in range(got.layout.num_layers):
        for src, dst in zip(case.src_ids, case.dst_ids):
            g, w = got.block(layer, dst), want.block(layer, src)
            for a, b in zip(g if isinstance(g, tuple) else (g,), w if isinstance(w, tuple) else (w,)):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (layer, src, dst)


def small_blocks_case() -> bt.Case:
    """4 layers x 8 scattered blocks of 16 tokens x 2 heads x 64 dim (4 KiB parts)."""
    return bt.make_case("4L x 8 blk", "blocks", bt.flash_layout(4, 2, 64), 32,
                        bt.scattered_ids(32, 8, 1), bt.scattered_ids(32, 8, 2))


def test_plain_socket_ceiling(benchmark, bench: bt.Bench) -> None:
    case = bt.contig_case(64 * bt.KiB)
    info = bench._setup(case, "tcp", plain=True)
    buf = bt.host_buffer(case.nbytes, value=0)
    view = bt.tensor_view(buf)
    client = bt.PlainClient(info["plain_port"])
    try:
        n = benchmark(client.fetch, view, case.nbytes)
    finally:
        client.close()
    assert n == case.nbytes
    assert torch.equal(buf, bt.host_buffer(case.nbytes, seed=bt.PLAIN_SEED))


def test_memcpy_ceiling(benchmark) -> None:
    n = 256 * bt.KiB
    src, dst = bt.host_buffer(n, seed=3), bt.host_buffer(n, value=0)
    benchmark(bt.memcpy, dst, src, n)
    assert torch.equal(src, dst)


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "noverify"])
def test_tcp_fetch_contiguous(benchmark, bench: bt.Bench, verify: bool) -> None:
    case = bt.contig_case(64 * bt.KiB)
    bench._setup(case, "tcp", plain=False)
    pool = bench._recv_pool(case)
    h = bench._handles(case, 1)[0]
    with KVReceiver(pool, verify=verify) as rv:
        res = benchmark(lambda: rv.fetch(h, case.dst_ids, release=False))
        assert res.ok and res.nbytes == case.nbytes, res.error
        assert rv.fetch(bench._handles(case, 1)[0], case.dst_ids).ok     # with release
    assert case.segments == 1
    assert_blocks_equal(pool, expected_pool(case), case)
    bench._check_dst(pool, case, h)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_fetch_scattered_blocks(benchmark, bench: bt.Bench, transport: str) -> None:
    case = small_blocks_case()
    assert case.segments == 4 * 2 * 8            # nothing merges: one run per part
    bench._setup(case, transport, plain=False)
    pool = bench._recv_pool(case)
    h = bench._handles(case, 1)[0]
    with KVReceiver(pool) as rv:
        res = benchmark(lambda: rv.fetch(h, case.dst_ids, release=False))
        assert res.ok and res.nbytes == case.nbytes, res.error
    assert_blocks_equal(pool, expected_pool(case), case)


def test_shm_fetch_contiguous(benchmark, bench: bt.Bench) -> None:
    case = bt.contig_case(256 * bt.KiB)
    bench._setup(case, "shm", plain=False)
    pool = bench._recv_pool(case)
    h = bench._handles(case, 1)[0]
    with KVReceiver(pool) as rv:
        res = benchmark(lambda: rv.fetch(h, case.dst_ids, release=False))
        assert res.ok and res.nbytes == case.nbytes, res.error
    assert_blocks_equal(pool, expected_pool(case), case)


def test_scattered_memcpy_ceiling_moves_the_same_parts() -> None:
    """The block-shaped shm ceiling copies exactly the parts kvbridge moves, part by part."""
    from kvbridge.integrity import block_checksums
    case = small_blocks_case()
    L = KVLayout.from_dict(case.layout)
    src, dst = KVPool.allocate(L, case.pool_blocks), KVPool.allocate(L, case.pool_blocks)
    bt.fill_pool(src, 5)
    pairs = bt.scattered_pairs(src, case.src_ids, dst, case.dst_ids)
    assert len(pairs) == case.segments
    for d, s in pairs:
        d[:] = s
    assert block_checksums(dst, case.dst_ids) == block_checksums(src, case.src_ids)


def test_tcp_read_only_4k(benchmark, bench: bt.Bench) -> None:
    """The latency path: transport.read alone, no checks, no release."""
    case = bt.contig_case(4 * bt.KiB)
    info = bench._setup(case, "tcp", plain=False)
    pool = bench._recv_pool(case)
    h = bench._handles(case, 1)[0]
    spans = Spans.of_blocks(pool, case.dst_ids)
    with KVReceiver(pool) as rv:
        tr = rv.transport(info["url"])
        n = benchmark(tr.read, info["url"], h, spans)
    assert n == 4096
    assert_blocks_equal(pool, expected_pool(case), case)


def test_driver_smoke(tmp_path: Path, capsys, bench: bt.Bench) -> None:
    """The whole driver on a tiny configuration (the module's sender): JSON + Markdown written."""
    out, md = tmp_path / "t.json", tmp_path / "t.md"
    b = bt.Bench(reps=2, quick=True, lat_iters=30, lat_reps=2, sizes=[bt.MiB], blocks=False, max_iters=10,
                 transports=["tcp", "shm"])      # ucx: test_driver_smoke_ucx
    b.nixl_shm = False                                # the NIXL peer: not in a smoke test
    b.run(sender=bench.sender)
    bt.emit(b, str(out), str(md))
    data = json.loads(out.read_text())
    rows = data["throughput"]
    assert {r["transport"] for r in rows} == {"tcp (verify)", "tcp (verify=False)",
                                             "shm (verify)", "shm (verify=False)"}
    for r in rows:
        assert len(r["kvbridge_s"]) == len(r["ceiling_s"]) == len(r["ratios"]) == 2
        assert r["target"] in (bt.TCP_TARGET_CONTIG, bt.SHM_TARGET) and r["pass"] in (True, False)
    assert len(data["latency"]) == 5 + 5 and all(len(x) == 30 for x in data["latency"][0]["samples_ns"])
    assert [r["case"] for r in data["latency"][5:]][:2] == ["memcpy 4 KiB", "shm read only (transport.read)"]
    table = md.read_text()
    assert table in capsys.readouterr().out
    assert "| 1 MiB | tcp (verify) |" in table and "4 KiB latency" in table
    assert "| shm fetch (with release), verify |" in table


def test_cli_args() -> None:
    with pytest.raises(SystemExit):
        bt.main(["--help"])


@pytest.mark.timeout(120)
def test_driver_smoke_ucx(tmp_path: Path, bench: bt.Bench) -> None:
    """The driver's ucx rows against the bare-ucxx ceiling (skipped without ucxx)."""
    if not bt.ucx_available():
        pytest.skip("ucxx is not installed (pip install 'kvbridge[ucx]')")
    out, md = tmp_path / "u.json", tmp_path / "u.md"
    b = bt.Bench(reps=2, quick=True, lat_iters=20, lat_reps=1, sizes=[bt.MiB], blocks=False, latency=False,
                 max_iters=5, transports=["ucx"])
    b.nixl = False
    b.run(sender=bench.sender)
    bt.emit(b, str(out), str(md))
    rows = json.loads(out.read_text())["throughput"]
    assert {r["transport"] for r in rows} == {"ucx (verify)", "ucx (verify=False)"}
    assert all(len(r["ratios"]) == 2 and r["ratios"][0] > 0 for r in rows)
