"""Fixtures: the Go example binary (built once, or $CUDASHARE_BIN), a
running Go producer on the simulated driver, and the Python fake producer."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the package, uninstalled
sys.path.insert(0, HERE)
REPO = os.path.dirname(os.path.dirname(HERE))

from fakeproducer import FakeProducer  # noqa: E402


@pytest.fixture(scope="session")
def gobin(tmp_path_factory):
    b = os.environ.get("CUDASHARE_BIN")
    if b:
        return b
    go = shutil.which("go")
    if go is None:
        pytest.skip("no Go toolchain and no $CUDASHARE_BIN: cannot run the Go producer")
    out = str(tmp_path_factory.mktemp("bin") / "cudashare")
    subprocess.run([go, "build", "-o", out, "./cmd/cudashare"], cwd=REPO, check=True)
    return out


def connected(fake, caps=0, credits=4, **kw):
    """A consumer connected to a fake producer (the fake fixture), once
    its hello has arrived as the consumer sends it."""
    import cudashare
    f = fake(caps)
    t = f.serve()
    c = cudashare.connect(f.path, credits=credits, backend="sim", **kw)
    t.join(5)
    assert f.hello[0] == 1 and f.hello[2] == 2 and f.hello[6] & ~8 == 1 and f.hello[7] == credits
    return f, c


_sharing = {}


def producer_has_sharing(gobin):
    """Whether this producer binary has the -sharing flag (vmm sharing)."""
    if gobin not in _sharing:
        h = subprocess.run([gobin, "producer", "-h"], capture_output=True, text=True)
        _sharing[gobin] = "-sharing" in h.stdout + h.stderr
    return _sharing[gobin]


class GoProducer:
    def __init__(self, gobin, *args):
        self.dir = tempfile.mkdtemp(prefix="cudashare-py-")
        os.chmod(self.dir, 0o700)
        self.path = os.path.join(self.dir, "sock", "s")
        env = dict(os.environ, CUDASHARE_DRIVER="sim", CUDASHARE_SIM_DIR=os.path.join(self.dir, "sim"))
        self.p = subprocess.Popen([gobin, "producer", "-socket", self.path, "-json", *args],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
        deadline = time.monotonic() + 10
        while not os.path.exists(self.path):
            if self.p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("producer did not start: %s" % self.p.stderr.read())
            time.sleep(0.01)

    def wait(self, timeout=15):
        out, err = self.p.communicate(timeout=timeout)
        self.err = err
        lines = [l for l in out.splitlines() if l.startswith("{")]
        return (json.loads(lines[-1]) if lines else None), self.p.returncode

    def kill(self, sig=signal.SIGKILL):
        if self.p.poll() is None:
            self.p.send_signal(sig)

    def close(self):
        self.kill()
        try:
            self.p.communicate(timeout=5)
        except Exception:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def go_producer(gobin):
    made = []

    def start(*args):
        p = GoProducer(gobin, *args)
        made.append(p)
        return p
    yield start
    for p in made:
        p.close()


@pytest.fixture
def fake():
    made = []

    def start(caps=0, seg=None):
        f = FakeProducer(caps, seg)
        made.append(f)
        return f
    yield start
    for f in made:
        f.close()


@pytest.fixture(autouse=True)
def no_fd_leak():
    """Every test leaves the descriptors it found: received fds are closed
    on every path."""
    before = set(os.listdir("/proc/self/fd"))
    yield
    for _ in range(50):
        after = set(os.listdir("/proc/self/fd"))
        if after <= before:
            return
        time.sleep(0.02)
    leaked = {}
    for fd in after - before:
        try:
            leaked[fd] = os.readlink("/proc/self/fd/" + fd)
        except OSError:
            pass
    leaked = {k: v for k, v in leaked.items() if "memfd" in v or "socket" in v}
    assert not leaked, "descriptors leaked: %r" % leaked
