"""bench/py_interop.py on the simulator: its loop, report and exit codes
with --framework host (the bytes on the host) against the Go producer and
against a fake producer that offers wrong data; the GPU frameworks skip
(exit 3, a "skipped" reason) where they are not installed."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, producer_has_sharing
from fakeproducer import sim_memfd

SCRIPT = os.path.join(REPO, "bench", "py_interop.py")
PYDIR = os.path.join(REPO, "python")
RELEASE, GOODBYE = 4, 8


def run(*args, timeout=60):
    env = dict(os.environ, CUDASHARE_DRIVER="sim", PYTHONPATH=PYDIR)
    return subprocess.Popen([sys.executable, SCRIPT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, text=True)


def report(p, timeout=60):
    out, err = p.communicate(timeout=timeout)
    lines = [l for l in out.splitlines() if l.startswith("{")]
    assert len(lines) == 1, (out, err)
    return json.loads(lines[0]), p.returncode, err


def test_host_against_go_producer(go_producer, gobin):
    sharing = ("-sharing", "vmm") if producer_has_sharing(gobin) else ()
    p = go_producer("-count", "40", "-ring", "4", "-size", "64KiB", *sharing)
    rep, code, err = report(run("--socket", p.path, "--framework", "host", "--wait", "10"))
    prep, pcode = p.wait()
    assert code == 0 and pcode == 0, (rep, err, p.err)
    assert rep["handoffs"] == 40 and rep["verified"] == 40 and rep["verify_errors"] == 0, rep
    assert rep["zero_copy"] == "40/40" and rep["driver"] == "sim" and rep["end"] == "producer said goodbye"
    assert rep["check"].endswith(": 0 wrong") and "error" not in rep
    assert prep["releases"] == 40


def test_host_batches_stops_early(go_producer, gobin):
    sharing = ("-sharing", "vmm") if producer_has_sharing(gobin) else ()
    p = go_producer("-count", "10", "-ring", "4", "-size", "64KiB", *sharing)
    rep, code, err = report(run("--socket", p.path, "--framework", "host", "--wait", "10", "--batches", "10"))
    assert code == 0 and rep["end"] == "count" and rep["verified"] == 10, (rep, err)
    p.wait()


def _lend(f, offers):
    """Serves offers (seq, fill, meta) from one allocation, then goodbye."""
    fd = sim_memfd(1 << 21, 0)
    try:
        for i, (seq, fill, meta) in enumerate(offers):
            os.pwrite(fd, bytes([fill]) * 4096, 4096 + i * 4096)
            f.offer(seq, size=4096, offset=i * 4096, kind=1, nfds=1 if i == 0 else 0,
                    fds=[fd] if i == 0 else (), meta=meta)
    finally:
        os.close(fd)
    got = []
    while len(got) < len(offers):
        m = f.recv_until(RELEASE)
        assert m is not None, got
        got += m[1]
    f.send([GOODBYE, "done"])
    return sorted(got)


def test_host_wrong_data_fails(fake):
    f = fake()
    t = f.serve()
    p = run("--socket", f.path, "--framework", "host", "--wait", "5")
    t.join(10)
    assert f.hello is not None
    u8 = {"dtype": "uint8", "shape": [4096]}
    assert _lend(f, [(1, 1, dict(batch=0, **u8)), (2, 9, dict(batch=1, **u8)), (3, 3, dict(batch=2, **u8))]) == [1, 2, 3]
    rep, code, err = report(p)
    assert code == 1, (rep, err)
    # batch 1 is all wrong (9, want 2): every batch counts as unverified,
    # the counter is over the whole run.
    assert rep["handoffs"] == 3 and rep["verified"] == 0 and rep["verify_errors"] == 3, rep
    assert rep["check"].endswith(": 4096 wrong") and rep["error"].startswith("wrong data"), rep


def test_host_batch_without_number_fails(fake):
    f = fake()
    t = f.serve()
    p = run("--socket", f.path, "--framework", "host", "--wait", "5")
    t.join(10)
    assert _lend(f, [(1, 1, {"batch": 0}), (2, 5, {"t": 1})]) == [1, 2]
    rep, code, err = report(p)
    assert code == 1 and rep["handoffs"] == 1 and rep["verified"] == 0 and rep["verify_errors"] == 2, (rep, err)


def test_no_producer_exits_4(tmp_path):
    rep, code, _ = report(run("--socket", str(tmp_path / "none"), "--framework", "host", "--wait", "0.2"))
    assert code == 4 and rep["exit"] == 4 and "no producer" in rep["error"]


@pytest.mark.parametrize("framework,module", [("cupy", "cupy"), ("cupy-dlpack", "cupy"), ("jax", "jax"),
                                              ("torch-cai", "torch")])
def test_gpu_frameworks_skip_here(framework, module, tmp_path):
    if importlib.util.find_spec(module) is not None:
        pytest.skip("%s is installed here: its skip is not what this test can see" % module)
    rep, code, _ = report(run("--socket", str(tmp_path / "none"), "--framework", framework, "--wait", "0.2"))
    assert code == 3 and rep["exit"] == 3 and rep["skipped"].startswith("no %s here" % module), rep
    assert rep["framework"] == framework and rep["handoffs"] == 0
