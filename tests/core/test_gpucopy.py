"""Batched device copies (kvbridge.transports.gpucopy): the plan that the kernel in
native/kv_copy.cu runs, checked on the host by running it with memmove against a plain copy of
the two byte streams; and on a GPU, the kernel itself against the same reference."""

from __future__ import annotations

import importlib.util
import random

import numpy as np
import pytest
import torch

from kvbridge.transports import gpucopy
from kvbridge.transports.staging import copy_pieces


def _streams(rng: random.Random, sizes: list[int], total: int, max_piece: int) -> list[tuple[int, int, int]]:
    """Random non-overlapping pieces over buffers of ``sizes`` adding up to ``total`` bytes
    (zero-length pieces among them)."""
    free = [(b, o) for b, n in enumerate(sizes) for o in range(0, n - max_piece, max_piece)]
    rng.shuffle(free)
    choices = [c for c in (0, 1, 7, 16, 4096, max_piece // 2) if c <= max_piece] + [max_piece] * 4
    out, left = [], total
    for b, o in free:
        if left <= 0:
            break
        n = min(left, rng.choice(choices))
        shift = rng.randrange(0, 3) * 8 if n <= max_piece - 16 else 0
        out.append((b, o + shift, n))
        left -= n
    assert left <= 0
    return out


def _reference(dst_flats, dst, src_flats, src) -> int:
    stream = torch.cat([src_flats[b][o:o + n] for b, o, n in src]) if src else torch.empty(0, dtype=torch.uint8)
    pos = 0
    for b, o, n in dst:
        k = min(n, stream.numel() - pos)
        if pos >= stream.numel():
            break
        dst_flats[b][o:o + k] = stream[pos:pos + k]
        pos += k
    return pos


@pytest.mark.parametrize("seed", range(8))
def test_a_plan_run_on_the_host_copies_what_a_plain_copy_does(seed: int) -> None:
    rng = random.Random(seed)
    piece = rng.choice([1 << 12, 1 << 16, 3 << 16])          # pieces above gpucopy.CHUNK are cut
    src_flats = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (1 << 20, 3 << 19)]
    sizes = [1 << 20, 1 << 19, 1 << 19]
    total = rng.randrange(1, 1 << 19)
    src = _streams(rng, [t.numel() for t in src_flats], total, piece)
    dst = src if seed % 2 else _streams(rng, sizes, total + rng.randrange(-4096, 4096), piece // 2 or 1)
    want = [torch.zeros(n, dtype=torch.uint8) for n in sizes] if dst is not src else \
        [torch.zeros(t.numel(), dtype=torch.uint8) for t in src_flats]
    got = [t.clone() for t in want]
    n_want = _reference(want, dst, src_flats, src)
    chunks = gpucopy.plan(got, dst, src_flats, src)
    assert len(chunks) and int(chunks[:, 2].max()) <= gpucopy.CHUNK and int(chunks[:, 2].min()) > 0
    assert gpucopy.run_on_host(chunks) == n_want
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # arrays in, the same plan out
    assert np.array_equal(gpucopy.plan(got, np.array(dst).reshape(-1, 3), src_flats, np.array(src)), chunks)


@pytest.mark.parametrize("bad", [(0, -8, 16), (0, (1 << 16) - 8, 16), (2, 0, 8), (-1, 0, 8), (0, 0, -1)])
def test_a_piece_outside_its_buffer_is_refused_before_anything_is_copied(bad: tuple[int, int, int]) -> None:
    flats = [torch.zeros(1 << 16, dtype=torch.uint8), torch.zeros(1 << 16, dtype=torch.uint8)]
    good = [(0, 0, 8), (1, 8, 8)]
    with pytest.raises(ValueError, match="outside its buffer"):
        gpucopy.plan(flats, good + [bad], flats, good + [(1, 64, abs(bad[2]))])
    with pytest.raises(ValueError, match="outside its buffer"):
        gpucopy.plan(flats, good + [(1, 64, abs(bad[2]))], flats, good + [bad])


def test_host_buffers_take_the_row_gathers() -> None:
    """copy_pieces on host tensors does not take the kernel path (and needs no CuPy)."""
    flats = [torch.arange(256, dtype=torch.uint8)]
    out = [torch.zeros(256, dtype=torch.uint8)]
    assert gpucopy.copy(out, [(0, 0, 16)], flats, [(0, 16, 16)]) is None
    assert copy_pieces(out, np.array([(0, 0, 16)]), flats, np.array([(0, 16, 16)])) == 16
    assert out[0][:16].tolist() == list(range(16, 32))


_NO_KERNEL = [w for w, ok in [("a CUDA device", torch.cuda.is_available()),
                              ("CuPy", importlib.util.find_spec("cupy") is not None)] if not ok]


@pytest.mark.gpu
@pytest.mark.skipif(bool(_NO_KERNEL), reason="the copy kernel needs " + " and ".join(_NO_KERNEL))
@pytest.mark.parametrize("seed", range(4))
def test_the_kernel_copies_what_a_plain_copy_does(seed: int) -> None:
    rng = random.Random(seed)
    piece = rng.choice([1 << 12, 1 << 15, 3 << 16])
    src_flats = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda") for n in (1 << 22, 3 << 21)]
    sizes = [1 << 22, 1 << 21]
    total = rng.randrange(1 << 20, 1 << 21)
    src = _streams(rng, [t.numel() for t in src_flats], total, piece)
    dst = _streams(rng, sizes, total, piece if seed % 2 else max(1, piece // 3))
    want = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in sizes]
    got = [t.clone() for t in want]
    n_want = _reference(want, dst, src_flats, src)
    assert gpucopy.copy(got, dst, src_flats, src) == n_want
    torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
