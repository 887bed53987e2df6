"""The command line: a light ``--help``, defaults shown, ports checked first, ``leases`` output,
benchmark output paths."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbridge.cli import build_parser, main
from kvbridge.layout import KVLayout
from kvbridge.pool import KVPool
from kvbridge.receiver import KVReceiver
from kvbridge.sender import KVSender

ROOT = Path(__file__).resolve().parents[2]


def _kvbridge(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "kvbridge", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.timeout(60)
def test_help_does_not_import_torch() -> None:
    code = ("import sys\nfrom kvbridge.cli import main\n"
            "for argv in (['--help'], ['up', '--help'], ['--version']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n")
    p = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().endswith("NO-TORCH")
    assert "Warning" not in p.stderr and "warning" not in p.stderr
    import kvbridge  # the public names still resolve (imported on first use)

    assert kvbridge.KVSender is KVSender and "KVPool" in dir(kvbridge)


def test_every_up_option_shows_its_default() -> None:
    ap = build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("up", "proxy", "prefill", "decode"):
        p = sub.choices[name]
        text = " ".join(p.format_help().split())
        for act in p._actions:
            if act.help in (None, argparse.SUPPRESS) or isinstance(act, (argparse._HelpAction,
                                                                         argparse._StoreTrueAction)):
                continue
            if act.default is None or act.default == []:
                continue
            assert f"(default: {act.default})" in text, (name, act.option_strings)


@pytest.mark.timeout(60)
def test_busy_or_invalid_port_fails_before_anything_starts() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        p = _kvbridge("up", "--port", str(port), "--model", "tiny", "--no-progress")
        assert p.returncode == 1
        assert f"--port {port}" in p.stderr and "already in use" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr and "lease server" not in p.stderr and "worker" not in p.stderr
        assert time.monotonic() - t0 < 30
        p = _kvbridge("proxy", "--port", str(port), "--colocated", "http://127.0.0.1:9")
        assert p.returncode == 1 and f"--port {port}" in p.stderr and "Traceback" not in p.stderr
    p = _kvbridge("up", "--port", "70000")
    assert p.returncode == 2 and "--port" in p.stderr and "0-65535" in p.stderr
    p = _kvbridge("decode", "--port", "http")
    assert p.returncode == 2 and "--port" in p.stderr


@pytest.mark.timeout(60)
def test_leases_separates_live_from_released(lease_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    layout = KVLayout.vllm_flash(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    src, dst = KVPool.allocate(layout, 16), KVPool.allocate(layout, 16)
    with KVSender(src, ["tcp://127.0.0.1:0"], leases=lease_url) as snd, KVReceiver(dst, leases=lease_url) as rcv:
        done = snd.publish("req-done", src.alloc(2), 8)
        waiting = snd.publish("req-waiting", src.alloc(2), 8)
        assert rcv.fetch(done, dst.alloc(2)).ok
        store = rcv.lease_store(done)
        assert store is not None
        deadline = time.monotonic() + 5.0       # the release goes after the fetch has returned
        while (lease := store.get(done.lease_id)) is not None and lease.state.value != "released" \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        url = lease_url
        capsys.readouterr()
        assert main(["leases", "--url", url, "--owner", snd.owner]) == 0
        out = capsys.readouterr().out
        live, _, ended = out.partition("ended lease(s)")
        assert snd.leases is not None
        ref_done, ref_waiting = snd.leases.ref(done.lease_id), snd.leases.ref(waiting.lease_id)
        assert out.startswith("1 live lease(s)") and ref_waiting in live and ref_done not in live
        assert ref_done in ended and "released" in ended
        assert "req-" not in out and done.lease_id not in out     # neither request ids nor lease ids
        assert main(["leases", "--url", url, "--owner", snd.owner, "--json"]) == 0
        rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert {r["ref"]: r["live"] for r in rows} == {ref_done: False, ref_waiting: True}


def test_e2e_bench_writes_to_scratch_unless_told() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench import e2e

    committed = str(ROOT / "bench" / "results")
    paths = e2e.output_paths(e2e.build_parser().parse_args([]))
    assert len(paths) == 3
    for path in paths:
        assert path and not str(Path(path).resolve()).startswith(committed), path
    paths = e2e.output_paths(e2e.build_parser().parse_args(["--out", "bench/results/e2e.json"]))
    assert paths == ("bench/results/e2e.json", "bench/results/e2e.md", "bench/results/e2e.png")
    paths = e2e.output_paths(e2e.build_parser().parse_args(["--out", "x/r.json", "--md", "y.md"]))
    assert paths == ("x/r.json", "y.md", "x/r.png")
