"""Copies of 1 MiB or more shared with the extension's helper thread, parts at a time
(``blockcopy.copy_threads``): the same bytes and the same checksums as one thread, for every
shape that takes the shared path (the two parts of one block among them) and every one that
must not (one part, under 1 MiB, one thread); a helper that sleeps, wakes late or is busy with another thread's
copy changes nothing; a copy whose bytes depend on its blocks' order (blocks moved within one
buffer, a destination named twice) stays on the calling thread; the helper blocks every signal;
a forked child starts its own, also when the fork came during another thread's copy; bad
settings are refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from kvbridge import blockcopy
from waiting import in_threads

from ._pools import checksum_of

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not blockcopy.NATIVE, reason="the extension is not built: copies run in Python")]

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _restore_settings():
    before = blockcopy.copy_threads()
    yield
    blockcopy.copy_threads(before["threads"], before["spin_us"])


def _shape(nblocks: int, nplanes: int, part: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    srcs = [torch.randint(0, 256, (nblocks * part,), dtype=torch.uint8, generator=g) for _ in range(nplanes)]
    dsts = [torch.zeros(nblocks * part, dtype=torch.uint8) for _ in range(nplanes)]

    def pl(ts):
        return blockcopy.pack_planes([(t.data_ptr(), part, t.data_ptr() + nblocks * part) for t in ts])
    return srcs, dsts, pl(srcs), pl(dsts)


def _check(srcs, dsts, part, sid, did, got, hashed):
    for k, (s, d) in enumerate(zip(sid, did)):
        parts = [bytes(t[s * part:(s + 1) * part].numpy()) for t in srcs]
        landed = b"".join(bytes(t[d * part:(d + 1) * part].numpy()) for t in dsts)
        assert landed == b"".join(parts), k
        if hashed:
            assert got[k] == checksum_of(parts), k
    if not hashed:
        assert got is None


# (blocks, planes, part): shared -- 8 MiB in four blocks, odd parts, an odd number of blocks,
# more parts than units, one block's two parts (16 MiB, and just over 1 MiB), tiny parts;
# never shared -- one block of one 16 MiB part, 672 KiB in 21 parts
SHAPES = [(4, 2, MiB), (4, 1, 2 * MiB + 64), (9, 3, 333 * 1000), (5000, 2, 1024), (1, 2, 8 * MiB),
          (1, 2, 512 * 1024 + 64), (3, 2, 2 * MiB), (5000, 2, 128), (1, 1, 16 * MiB), (7, 3, 32 * 1024)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
def test_shared_copies_land_the_bytes_and_their_digests(shape, threads):
    nblocks, nplanes, part = shape
    blockcopy.copy_threads(threads, 50)
    srcs, dsts, sp, dp = _shape(nblocks, nplanes, part, seed=nblocks + part)
    sid = list(range(nblocks))
    did = sid[::-1]
    jobs = blockcopy.copy_threads()["jobs"]
    for mode in (1, 0, 2, 3):        # the fastest pass, no hash, the chunked pass, AVX2's
        for t in dsts:
            t.zero_()
        got = blockcopy.copy_blocks(dp, did, sp, sid, part, mode)
        _check(srcs, dsts, part, sid, did, got, mode != 0)
    if sys.platform == "linux":      # offered to the helper exactly where promised: 1 MiB+, 2+ parts;
        total = nblocks * nplanes * part   # under 8 MiB only to a helper that is polling already
        shared = threads == 2 and nblocks * nplanes >= 2 and total >= MiB
        offered = blockcopy.copy_threads()["jobs"] - jobs
        if shared and total >= 8 * MiB:
            assert offered == 4
        else:
            assert offered <= (4 if shared else 0)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def test_the_helper_takes_part_and_one_thread_means_none():
    if sys.platform != "linux" or _cpus() < 2:
        pytest.skip("the helper runs on Linux with two CPUs or more")
    srcs, dsts, sp, dp = _shape(4, 2, MiB, seed=5)
    ids = [0, 1, 2, 3]
    blockcopy.copy_threads(1)
    before = blockcopy.copy_threads()
    for _ in range(3):
        blockcopy.copy_blocks(dp, ids, sp, ids, MiB, 1)
    assert blockcopy.copy_threads()["jobs"] == before["jobs"]         # one thread: nothing offered
    blockcopy.copy_threads(2, 1000)
    one = _shape(1, 1, 8 * MiB, seed=6)
    blockcopy.copy_blocks(one[3], [0], one[2], [0], 8 * MiB, 1)
    assert blockcopy.copy_threads()["jobs"] == before["jobs"]         # one part: never split
    deadline = time.monotonic() + 20
    while blockcopy.copy_threads()["helper_units"] == before["helper_units"]:
        assert time.monotonic() < deadline, "the helper never took part in an 8 MiB copy of four blocks"
        got = blockcopy.copy_blocks(dp, ids[::-1], sp, ids, MiB, 1)
        _check(srcs, dsts, MiB, ids, ids[::-1], got, True)
    after = blockcopy.copy_threads()
    assert after["jobs"] > before["jobs"] and after["helped"] > before["helped"]
    assert after["units"] - before["units"] > after["helper_units"] - before["helper_units"]


def test_a_helper_that_sleeps_between_copies_or_wakes_late_changes_nothing():
    """spin 0: the helper sleeps after every copy, so each copy may finish before it wakes (the
    caller then takes its job back) or meet it part-way; every digest is still the bytes'."""
    blockcopy.copy_threads(2, 0)
    part, ids = 256 * 1024, list(range(16))
    srcs, dsts, sp, dp = _shape(16, 2, part, seed=9)
    want = [checksum_of([bytes(srcs[0][b * part:(b + 1) * part].numpy()),
                         bytes(srcs[1][b * part:(b + 1) * part].numpy())]) for b in ids]
    for i in range(200):
        dsts[i % 2].zero_()
        assert blockcopy.copy_blocks(dp, ids, sp, ids, part, 1) == want, i
    assert all(torch.equal(s, d) for s, d in zip(srcs, dsts))


def test_copies_from_several_threads_at_once():
    """One copy at a time is shared; the others run on their own threads meanwhile."""
    blockcopy.copy_threads(2, 50)

    def worker(seed: int) -> None:
        part, ids = MiB, [0, 1, 2, 3]
        srcs, dsts, sp, dp = _shape(4, 2, part, seed=seed)
        want = [checksum_of([bytes(srcs[0][b * part:(b + 1) * part].numpy()),
                             bytes(srcs[1][b * part:(b + 1) * part].numpy())]) for b in ids]
        for _ in range(15):
            for t in dsts:
                t.zero_()
            assert blockcopy.copy_blocks(dp, ids, sp, ids, part, 1) == want
            assert all(torch.equal(s, d) for s, d in zip(srcs, dsts))
            assert blockcopy.copy_blocks(dp, ids, sp, ids, part, 0) is None
    errors = in_threads(worker, 4)
    assert not errors, errors


def test_blocks_that_partly_overlap_their_source():
    """Blocks read into parts that partly overlap their sources (hand-made planes over one
    buffer) are copied as memmove does and hashed as landed (a copy within one buffer whose
    spans meet runs on the calling thread, see the test below)."""
    blockcopy.copy_threads(2, 50)
    part, stride, ids = 2 * MiB, 2 * MiB + 8192, [0, 1, 2, 3]
    for mode in (1, 0):
        buf = torch.randint(0, 256, (4 * stride,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
        want = [bytes(buf[b * stride + 4096:b * stride + 4096 + part].numpy()) for b in ids]
        base, end = buf.data_ptr(), buf.data_ptr() + 4 * stride
        got = blockcopy.copy_blocks(blockcopy.pack_planes([(base, stride, end)]), ids,
                                    blockcopy.pack_planes([(base + 4096, stride, end)]), ids, part, mode)
        assert [bytes(buf[b * stride:b * stride + part].numpy()) for b in ids] == want
        assert got == ([checksum_of([w]) for w in want] if mode else None)


def test_blocks_moved_within_one_buffer_land_in_order():
    """Blocks moved down within one buffer (destinations 0..3 from sources 1..4: each block's
    destination is the source of the block before it) land as the one-thread copy and the
    Python twin land them, block by block in order, each read before it is overwritten. Shared,
    the caller takes its tail from the end while the helper copies at the same time, so block 2
    would be read after (or while) block 3 was overwritten: a copy whose destination blocks
    span its source blocks stays on the calling thread. One within one buffer whose two spans
    do not meet is still shared."""
    part, n = 2 * MiB, 5
    orig = torch.randint(0, 256, (n * part,), dtype=torch.uint8, generator=torch.Generator().manual_seed(11))
    blocks = [bytes(orig[b * part:(b + 1) * part].numpy()) for b in range(n)]
    for threads in (2, 1):
        blockcopy.copy_threads(threads, 50)
        for mode in (1, 0, 2):
            buf, twin = orig.clone(), orig.clone()
            pl = blockcopy.pack_planes([(buf.data_ptr(), part, buf.data_ptr() + n * part)])
            tpl = blockcopy.pack_planes([(twin.data_ptr(), part, twin.data_ptr() + n * part)])
            got = blockcopy.copy_blocks(pl, [0, 1, 2, 3], pl, [1, 2, 3, 4], part, mode)
            want = blockcopy.py_copy_blocks(tpl, [0, 1, 2, 3], tpl, [1, 2, 3, 4], part, mode != 0)
            landed = [bytes(buf[b * part:(b + 1) * part].numpy()) for b in range(n)]
            assert landed == blocks[1:] + blocks[4:], (threads, mode, [blocks.index(x) if x in blocks else None
                                                                       for x in landed])
            assert torch.equal(buf, twin) and got == want, (threads, mode)
    if sys.platform != "linux":
        return
    blockcopy.copy_threads(2, 50)
    far = torch.randint(0, 256, (12 * part,), dtype=torch.uint8, generator=torch.Generator().manual_seed(12))
    want = [bytes(far[b * part:(b + 1) * part].numpy()) for b in range(8, 12)]
    pl = blockcopy.pack_planes([(far.data_ptr(), part, far.data_ptr() + 12 * part)])
    jobs = blockcopy.copy_threads()["jobs"]
    got = blockcopy.copy_blocks(pl, [0, 1, 2, 3], pl, [8, 9, 10, 11], part, 1)
    assert blockcopy.copy_threads()["jobs"] == jobs + 1                  # offered to the helper
    assert [bytes(far[b * part:(b + 1) * part].numpy()) for b in range(4)] == want
    assert got == [checksum_of([w]) for w in want]


@pytest.mark.parametrize("case", ["one block named twice", "blocks that overlap one another"])
def test_destination_blocks_that_meet_land_as_one_thread_lands_them(case):
    """A destination block named twice (or destination blocks closer than a part apart) takes the
    bytes of the last block that names it, as the one-thread copy and the Python twin do: shared,
    both threads would write it at once (a torn block, or the earlier source's bytes). Such
    copies stay on the calling thread."""
    part = 2 * MiB
    src = torch.randint(0, 256, (4 * part,), dtype=torch.uint8, generator=torch.Generator().manual_seed(13))
    sp = blockcopy.pack_planes([(src.data_ptr(), part, src.data_ptr() + 4 * part)])
    did, stride = ([0, 1, 2, 2], part) if case == "one block named twice" else ([0, 1, 2, 3], part // 2)
    size = 3 * part if stride == part else 3 * stride + part

    def run(copy):
        dst = torch.zeros(size, dtype=torch.uint8)
        dp = blockcopy.pack_planes([(dst.data_ptr(), stride, dst.data_ptr() + size)])
        return dst, copy(dp, did, sp, [0, 1, 2, 3], part, 1)

    twin, want = run(lambda *a: blockcopy.py_copy_blocks(*a[:5], True))
    for threads in (2, 1):
        blockcopy.copy_threads(threads, 50)
        for i in range(10):
            dst, got = run(blockcopy.copy_blocks)
            assert torch.equal(dst, twin), (threads, i)
            assert got == want, (threads, i)


def test_bad_settings_are_refused():
    for bad in ({"threads": 0}, {"threads": 3}, {"threads": True}, {"threads": "2"}, {"spin_us": -1},
                {"spin_us": 100001}, {"spin_us": 1.5}):
        with pytest.raises(ValueError, match="copy_threads"):
            blockcopy.copy_threads(**bad)
    env = dict(os.environ, KVBRIDGE_COPY_THREADS="4")
    out = subprocess.run([sys.executable, "-c", "import kvbridge.blockcopy"], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "KVBRIDGE_COPY_THREADS='4'" in out.stderr


def _until_helped(dp, sp, ids, part, seconds: float = 20) -> None:
    start = blockcopy.copy_threads()["helper_units"]
    deadline = time.monotonic() + seconds
    while blockcopy.copy_threads()["helper_units"] == start:
        assert time.monotonic() < deadline, "the helper never took part"
        blockcopy.copy_blocks(dp, ids, sp, ids, part, 0)


def test_the_helper_blocks_every_signal():
    """Process-directed signals never land on the helper (README: it blocks every signal)."""
    if sys.platform != "linux" or _cpus() < 2:
        pytest.skip("the helper runs on Linux with two CPUs or more")
    blockcopy.copy_threads(2, 1000)
    srcs, dsts, sp, dp = _shape(4, 2, MiB, seed=21)
    _until_helped(dp, sp, [0, 1, 2, 3], MiB)
    masks = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "kvbridge-copy":
                    continue
            with open(f"/proc/self/task/{tid}/status") as f:
                masks += [int(line.split()[1], 16) for line in f if line.startswith("SigBlk:")]
        except FileNotFoundError:
            continue
    assert len(masks) == 1, masks
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE,
                signal.SIGALRM, signal.SIGTERM, signal.SIGCHLD, signal.SIGWINCH, signal.SIGRTMAX):
        assert masks[0] >> (sig - 1) & 1, (sig, hex(masks[0]))


# What the subprocess scripts below start from: the helper on, and four blocks of 2 MiB (8 MiB:
# shared) in a source and a destination buffer with their planes.
_BUFFERS = """
import ctypes, os, sys, threading, time
from kvbridge import blockcopy
blockcopy.copy_threads(2, 1000)
part, n = 2 << 20, 4
src = ctypes.create_string_buffer(os.urandom(n * part), n * part)
dst = ctypes.create_string_buffer(n * part)
s, d = ctypes.addressof(src), ctypes.addressof(dst)
sp = blockcopy.pack_planes([(s, part, s + n * part)])
dp = blockcopy.pack_planes([(d, part, d + n * part)])
ids = [0, 1, 2, 3]

def helped_within(seconds, copy):   # copy() until the helper took part in one (True), or False
    start = blockcopy.copy_threads()["helper_units"]
    deadline = time.monotonic() + seconds
    while blockcopy.copy_threads()["helper_units"] == start:
        if time.monotonic() > deadline:
            return False
        copy()
    return True
"""


def test_a_forked_child_starts_its_own_helper(tmp_path):
    if sys.platform != "linux" or _cpus() < 2:
        pytest.skip("the helper runs on Linux with two CPUs or more")
    script = _BUFFERS + textwrap.dedent("""
        import xxhash
        order = [3, 2, 1, 0]
        # one part per block: the checksum of its one digest
        want = [xxhash.xxh3_64_intdigest(xxhash.xxh3_64_intdigest(src.raw[b * part:(b + 1) * part])
                                         .to_bytes(8, "little")) for b in order]
        moved = b"".join(src.raw[b * part:(b + 1) * part] for b in order)
        def checked_copy():
            assert blockcopy.copy_blocks(dp, ids, sp, order, part, 1) == want
            assert dst.raw == moved
        def until_helped():
            assert helped_within(20, checked_copy), "no helper"
        until_helped()
        pid = os.fork()
        if pid == 0:
            try:
                until_helped()          # the parent's helper is not in the child: a new one
                os._exit(0)
            except BaseException as exc:
                print("child:", exc, file=sys.stderr)
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        until_helped()
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr


def test_a_child_forked_while_another_thread_copies_starts_its_own_helper():
    """A fork while another thread's copy holds the helper (its job taken, the one-job lock held)
    leaves the child a free lock and no helper: the child's own copies are shared again."""
    if sys.platform != "linux" or _cpus() < 2:
        pytest.skip("the helper runs on Linux with two CPUs or more")
    script = _BUFFERS + textwrap.dedent("""
        stop = False
        def busy():
            while not stop:
                blockcopy.copy_blocks(dp, ids, sp, ids, part, 0)   # the GIL let go for each
        t = threading.Thread(target=busy, daemon=True)
        t.start()
        time.sleep(0.2)
        bad = 0
        for i in range(4):
            time.sleep(0.01)
            pid = os.fork()
            if pid == 0:
                os._exit(0 if helped_within(5, lambda: blockcopy.copy_blocks(dp, ids, sp, ids, part, 0)) else 3)
            _, status = os.waitpid(pid, 0)
            bad += os.waitstatus_to_exitcode(status) != 0
        stop = True
        t.join()
        sys.exit(bad)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (out.returncode, out.stderr)


_ATFORK_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
/* pthread_atfork (libc_nonshared) calls this: when the extension registers its handler, say so on
 * KVB_ATFORK_FD and take 300 ms first, holding open whatever window the caller is in */
int __register_atfork(void (*prepare)(void), void (*parent)(void), void (*child)(void), void *dso) {
    int (*real)(void (*)(void), void (*)(void), void (*)(void), void *) =
        (int (*)(void (*)(void), void (*)(void), void (*)(void), void *))dlsym(RTLD_NEXT, "__register_atfork");
    Dl_info info;
    const char *fd = getenv("KVB_ATFORK_FD");
    if (fd && dso && dladdr(dso, &info) && info.dli_fname && strstr(info.dli_fname, "_kvcopy")) {
        char c = 1;
        if (write(atoi(fd), &c, 1) != 1)
            abort();
        usleep(300000);
    }
    return real(prepare, parent, child, dso);
}
"""


def test_a_child_forked_during_the_first_shared_copy_gets_a_helper(tmp_path):
    """The fork handler that frees the one-job lock in a child is registered before that lock is
    first taken: a fork while another thread makes the process's first shared copy (the lock
    held, the helper being started) leaves the child a lock it can take. Made reproducible by a
    preloaded shim that holds the extension's handler registration open for 300 ms."""
    if sys.platform != "linux" or _cpus() < 2:
        pytest.skip("the helper runs on Linux with two CPUs or more")
    import shutil
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the shim")
    shim = tmp_path / "atfork_shim.so"
    (tmp_path / "shim.c").write_text(_ATFORK_SHIM)
    build = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(shim), str(tmp_path / "shim.c"), "-ldl"],
                           capture_output=True, text=True)
    if build.returncode != 0:
        pytest.skip(f"the shim did not build: {build.stderr[-300:]}")
    script = _BUFFERS + textwrap.dedent("""
        import select
        r = int(sys.argv[1])
        assert blockcopy.copy_threads()["jobs"] == 0
        t = threading.Thread(target=blockcopy.copy_blocks, args=(dp, ids, sp, ids, part, 0))
        t.start()                                   # the process's first shared copy
        assert select.select([r], [], [], 10)[0], "the extension never registered its fork handler"
        pid = os.fork()
        if pid == 0:
            os._exit(0 if helped_within(3, lambda: blockcopy.copy_blocks(dp, ids, sp, ids, part, 0)) else 3)
        _, status = os.waitpid(pid, 0)
        t.join()
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    r, w = os.pipe()
    try:
        env = dict(os.environ, LD_PRELOAD=str(shim), KVB_ATFORK_FD=str(w))
        out = subprocess.run([sys.executable, "-c", script, str(r)], env=env, pass_fds=(r, w),
                             capture_output=True, text=True, timeout=60)
    finally:
        os.close(r)
        os.close(w)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])


def test_the_helper_runs_on_the_processs_cpus_not_its_starters() -> None:
    """A thread pinned to one CPU whose copy starts the helper: the helper used to inherit that
    pin, and every shared copy then ran on one CPU, slower than no sharing at all."""
    if sys.platform != "linux" or _cpus() < 2:
        pytest.skip("the helper runs on Linux with two CPUs or more")
    script = _BUFFERS + textwrap.dedent("""
        first = min(os.sched_getaffinity(0))
        def pinned():
            os.sched_setaffinity(0, {first})
            blockcopy.copy_blocks(dp, [0, 1, 2, 3], sp, [0, 1, 2, 3], part, 1)
        t = threading.Thread(target=pinned)
        t.start(); t.join()
        for tid in os.listdir("/proc/self/task"):
            try:                      # a thread that ended since the listing is gone from /proc
                comm = open(f"/proc/self/task/{tid}/comm").read().strip()
            except FileNotFoundError:
                continue
            if comm == "kvbridge-copy":
                got = os.sched_getaffinity(int(tid))
                sys.exit(0 if got == os.sched_getaffinity(0) else f"helper on {sorted(got)}")
        sys.exit("no helper thread")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def _tree(tmp_path, files: dict[str, str], cgroup: str):
    for rel, text in files.items():
        f = tmp_path / "sys" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    (tmp_path / "cgroup").write_text(cgroup)
    return str(tmp_path / "cgroup"), str(tmp_path / "sys")


def test_the_cpu_quota_is_read_from_cgroup_v2_and_v1(tmp_path):
    """The helper's default counts the cgroup's CPU quota beside the affinity: a container
    allowed one CPU's time (cpu.max "100000 100000") gets no helper even on a many-core
    affinity. v2 reads cpu.max of the cgroup and its ancestors (the least counts); v1 reads
    cpu.cfs_quota_us / cpu.cfs_period_us; "max" and -1 are no quota."""
    from kvbridge.hostlimits import cpu_quota
    v2 = {"cgroup.controllers": "cpu", "cpu.max": "max 100000\n", "kube/cpu.max": "250000 100000\n",
          "kube/pod/cpu.max": "max 100000\n"}
    assert cpu_quota(*_tree(tmp_path / "a", v2, "0::/kube/pod\n")) == 2.5
    v2["kube/pod/cpu.max"] = "50000 100000\n"
    assert cpu_quota(*_tree(tmp_path / "b", v2, "0::/kube/pod\n")) == 0.5
    assert cpu_quota(*_tree(tmp_path / "c", {"cgroup.controllers": "", "cpu.max": "max 100000\n"}, "0::/\n")) is None
    v1 = {"cpu,cpuacct/docker/x/cpu.cfs_quota_us": "150000\n", "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000\n",
          "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}
    assert cpu_quota(*_tree(tmp_path / "d", v1, "4:memory:/docker/x\n3:cpu,cpuacct:/docker/x\n0::/\n")) == 1.5
    hybrid = {"unified/cpu.max": "300000 100000\n", "cpu/cpu.cfs_quota_us": "-1\n",
              "cpu/cpu.cfs_period_us": "100000\n"}
    assert cpu_quota(*_tree(tmp_path / "e", hybrid, "1:cpu:/\n0::/\n")) == 3.0
    assert cpu_quota(str(tmp_path / "nowhere"), str(tmp_path)) is None
    assert cpu_quota(*_tree(tmp_path / "f", {"cgroup.controllers": "", "cpu.max": "garbage\n"}, "0::/\n")) is None


def test_a_one_cpu_quota_starts_no_helper(tmp_path, monkeypatch):
    from kvbridge import blockcopy
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(blockcopy, "cpu_quota", lambda: 1.0)
    assert blockcopy._default_copy_threads() == 1
    monkeypatch.setattr(blockcopy, "cpu_quota", lambda: 2.0)
    assert blockcopy._default_copy_threads() == 2
    monkeypatch.setattr(blockcopy, "cpu_quota", lambda: None)
    assert blockcopy._default_copy_threads() == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert blockcopy._default_copy_threads() == 1


def test_a_small_copy_is_shared_only_with_a_helper_that_is_polling():
    """From 1 MiB to under 8 MiB a copy is offered to the helper only while it polls for one
    (after a copy it took part in, for ``spin_us``): one asleep is not woken for it -- the
    caller copies alone, with no system call. A 1 MiB block of two parts is then split between
    the two threads, with the same bytes and checksum."""
    if sys.platform != "linux" or _cpus() < 2:
        pytest.skip("the helper runs on Linux with two CPUs or more")
    small = _shape(1, 2, 512 * 1024, seed=21)
    big = _shape(4, 2, MiB, seed=22)
    blockcopy.copy_threads(2, 0)                  # it sleeps right after every copy
    blockcopy.copy_blocks(big[3], [0, 1, 2, 3], big[2], [0, 1, 2, 3], MiB, 1)   # started (8 MiB wakes it)
    time.sleep(0.05)
    jobs = blockcopy.copy_threads()["jobs"]
    for _ in range(5):
        got = blockcopy.copy_blocks(small[3], [0], small[2], [0], 512 * 1024, 1)
        _check(small[0], small[1], 512 * 1024, [0], [0], got, True)
    assert blockcopy.copy_threads()["jobs"] == jobs                      # asleep: not offered
    blockcopy.copy_threads(2, 100_000)            # it polls for 100 ms after a copy
    deadline = time.monotonic() + 20
    while True:
        blockcopy.copy_blocks(big[3], [0, 1, 2, 3], big[2], [0, 1, 2, 3], MiB, 1)
        before = blockcopy.copy_threads()
        got = blockcopy.copy_blocks(small[3], [0], small[2], [0], 512 * 1024, 1)
        _check(small[0], small[1], 512 * 1024, [0], [0], got, True)
        after = blockcopy.copy_threads()
        if after["helper_units"] > before["helper_units"]:
            break                                 # the block's second part ran on the helper
        assert time.monotonic() < deadline, "a polling helper never took part of a 1 MiB block"
    assert after["jobs"] == before["jobs"] + 1


@pytest.mark.parametrize("shape", [(1, 2, 8 * MiB), (4, 3, MiB), (700, 8, 2048)], ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
def test_checksums_alone_are_shared_too(shape):
    """``hash_blocks`` (the sender's checksums at publish) shares its parts the same way: the
    same checksums (the Python twin's) on one thread and on two, per block and per layer."""
    nblocks, nplanes, part = shape
    srcs, _, sp, _ = _shape(nblocks, nplanes, part, seed=nblocks)
    ids = list(range(nblocks))[::-1]
    for group in (1, nplanes):
        want = blockcopy.py_hash_blocks(sp, ids, part, group)
        for threads in (1, 2):
            blockcopy.copy_threads(threads, 50)
            jobs = blockcopy.copy_threads()["jobs"]
            assert blockcopy.hash_blocks(sp, ids, part, group) == want, (group, threads)
            if sys.platform == "linux" and nblocks * nplanes * part >= 8 * MiB:
                assert blockcopy.copy_threads()["jobs"] == jobs + (threads == 2)
