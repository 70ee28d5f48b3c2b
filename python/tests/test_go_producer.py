"""The consumer against the Go example producer on the simulated driver:
the protocol end to end, credits, retire/closed, goodbye both ways, a
producer killed, a consumer killed, SIGTERM, and the CLI's report."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

import cudashare
from conftest import REPO, producer_has_sharing

PY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_consume_until_goodbye(go_producer):
    p = go_producer("-count", "20", "-size", "64KiB")
    with cudashare.connect(p.path, backend="sim", wait=5) as c:
        n = 0
        for lease in c:
            with lease:
                assert lease.meta["batch"] == n and lease.meta["dtype"] == "uint8"
                assert lease.view() == ("uint8", (65536,))
                n += 1
        st = c.stats()
    rep, code = p.wait()
    assert n == 20 and code == 0, p.err
    assert rep["releases"] == 20 and rep["allocations_left"] == 0 and rep["consumers_lost"] == 0
    assert st["mappings"] == 1 and st["closed"] == 1  # one open, retire answered
    assert rep["shutdown_seconds"] < 5  # goodbye half-closes: nobody waits for a timeout


def test_credits_bound_what_is_held(go_producer):
    p = go_producer("-count", "5", "-size", "64KiB")
    with cudashare.connect(p.path, backend="sim", credits=2, wait=5) as c:
        a, b = c.next(timeout=5), c.next(timeout=5)
        with pytest.raises(cudashare.Timeout):
            c.next(timeout=0.3)  # a third offer would break the window
        a.release()
        c.next(timeout=5).release()
        b.release()
        for l in c:
            l.release()
    assert p.wait()[1] == 0


def test_consumer_close_says_goodbye(go_producer):
    p = go_producer("-size", "64KiB")
    c = cudashare.connect(p.path, backend="sim", wait=5)
    held = c.next(timeout=5)
    c.close()
    assert held.released
    p.kill(signal.SIGINT)
    rep, code = p.wait()
    assert code == 0 and rep["consumers_lost"] == 0, p.err


def test_producer_killed(go_producer):
    p = go_producer("-size", "64KiB")
    c = cudashare.connect(p.path, backend="sim", wait=5)
    c.next(timeout=5).release()
    p.kill()
    with pytest.raises(cudashare.ProducerGone):
        for _ in range(100):
            c.next(timeout=5).release()
    c.close()


def _child(path, body):
    code = textwrap.dedent("""
        import os, signal, sys, time
        sys.path.insert(0, %r)
        import cudashare
        c = cudashare.connect(%r, backend="sim", wait=5, handle_sigterm=True)
        l = c.next(timeout=5)
        print("holding", flush=True)
    """ % (PY, path)) + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_consumer_killed(go_producer):
    p = go_producer("-count", "30", "-size", "64KiB")
    ch = _child(p.path, "time.sleep(60)")
    assert ch.stdout.readline().strip() == "holding"
    ch.kill()
    ch.wait()
    with cudashare.connect(p.path, backend="sim", wait=5) as c:
        for l in c:
            l.release()
    rep, code = p.wait()
    assert code == 0 and rep["consumers_lost"] == 1, (rep, p.err)


def test_sigterm_says_goodbye(go_producer):
    p = go_producer("-size", "64KiB")
    ch = _child(p.path, "time.sleep(60)")
    assert ch.stdout.readline().strip() == "holding"
    ch.send_signal(signal.SIGTERM)
    assert ch.wait(10) == 128 + signal.SIGTERM
    p.kill(signal.SIGINT)
    rep, code = p.wait()
    assert code == 0 and rep["consumers_lost"] == 0, (rep, p.err)


def test_cli_report_matches_go(go_producer, gobin):
    p = go_producer("-count", "10", "-size", "64KiB")
    r = subprocess.run([sys.executable, "-m", "cudashare", "consume", "--socket", p.path, "--verify", "none",
                        "--wait", "5"], cwd=PY, capture_output=True, text=True, timeout=30,
                       env=dict(os.environ, CUDASHARE_DRIVER="sim"))
    assert r.returncode == 0, r.stderr
    py = json.loads(r.stdout.strip().splitlines()[-1])
    assert py["handoffs"] == 10 and py["end"] == "producer said goodbye" and py["driver"] == "sim"
    assert p.wait()[1] == 0
    p2 = go_producer("-count", "3", "-size", "64KiB")
    g = subprocess.run([gobin, "consumer", "-socket", p2.path, "-json", "-verify", "none", "-wait", "5s"],
                       capture_output=True, text=True, timeout=30,
                       env=dict(os.environ, CUDASHARE_DRIVER="sim", CUDASHARE_SIM_DIR=os.path.join(p2.dir, "sim")))
    go = json.loads(g.stdout.strip().splitlines()[-1])
    assert set(go) - {"read_test", "error"} <= set(py), set(go) - set(py)


def test_cli_sigterm(go_producer):
    """SIGTERM ends the CLI as SIGINT does: leases released, goodbye said,
    the report printed, exit 0 (the Go consumer's end "signal")."""
    p = go_producer("-size", "64KiB")
    cli = subprocess.Popen([sys.executable, "-m", "cudashare", "consume", "--socket", p.path, "--verify", "byte",
                            "--wait", "5"], cwd=PY, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=dict(os.environ, CUDASHARE_DRIVER="sim"))
    try:
        time.sleep(1.5)  # connected and consuming; the report says if not
        cli.send_signal(signal.SIGTERM)
        out, err = cli.communicate(timeout=20)
    finally:
        cli.kill()
    assert cli.returncode == 0, err
    rep = json.loads(out.strip().splitlines()[-1])
    assert rep["end"] == "signal" and rep["handoffs"] > 0 and rep["exit"] == 0, rep
    p.kill(signal.SIGINT)
    prep, code = p.wait()
    assert code == 0 and prep["consumers_lost"] == 0 and prep["allocations_left"] == 0, (prep, p.err)


def _cli_patched(p, patch, *args):
    """Runs the CLI's main() in a child with `patch` applied first, to land a
    signal at an exact moment."""
    code = textwrap.dedent("""
        import os, signal, sys, threading, time
        import cudashare, cudashare._backends, cudashare._consumer
        from cudashare import __main__ as m
    """) + textwrap.dedent(patch) + textwrap.dedent("""
        sys.exit(m.main(["consume", "--socket", %r, "--wait", "5"] + %r))
    """ % (p.path, list(args)))
    return subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], cwd=PY, capture_output=True,
                          text=True, timeout=30, env=dict(os.environ, CUDASHARE_DRIVER="sim"))


@pytest.mark.parametrize("signals", [1, 2])
def test_cli_sigterm_while_a_worker_reads(go_producer, signals):
    """SIGTERM while a worker thread copies a batch out of its mapping: the
    main thread must stop the workers before it closes the mappings (it used
    to unmap under the copy: SIGSEGV), even when a second SIGTERM (a process
    group signalled twice) lands while it waits for them."""
    p = go_producer("-size", "64KiB")
    cli = _cli_patched(p, """
        orig = cudashare._backends.SimBackend.copy_to_host
        fired = []
        unmapped = threading.Event()
        def slow_copy(self, *a, **k):
            if not fired:
                fired.append(1)
                os.kill(os.getpid(), signal.SIGTERM)
                if %d == 2:
                    time.sleep(0.3)  # the main thread waits for the workers now
                    os.kill(os.getpid(), signal.SIGTERM)
                unmapped.wait(1)  # a long copy under way when the run ends
            return orig(self, *a, **k)
        cudashare._backends.SimBackend.copy_to_host = slow_copy
        oclose = cudashare._backends.SimBackend.close
        def close(self, m):
            oclose(self, m)
            unmapped.set()
            time.sleep(0.2)
        cudashare._backends.SimBackend.close = close
    """ % signals, "--verify", "full", "--workers", "1")
    p.kill(signal.SIGINT)
    assert cli.returncode == 0, (cli.returncode, cli.stderr[-4000:])
    assert json.loads(cli.stdout.strip().splitlines()[-1])["end"] == "signal"


def test_cli_sigterm_during_close(go_producer):
    """SIGTERM while the run's end closes the connection (a process group
    signalled at the producer's goodbye, say): the goodbye and the report
    must not be cut short."""
    p = go_producer("-size", "64KiB", "-count", "5")
    cli = _cli_patched(p, """
        orig = cudashare._consumer.Consumer.close
        def close(self, *a, **k):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            return orig(self, *a, **k)
        cudashare._consumer.Consumer.close = close
    """)
    assert cli.returncode == 0, (cli.returncode, cli.stderr[-4000:])
    assert json.loads(cli.stdout.strip().splitlines()[-1])["handoffs"] == 5
    rep, code = p.wait()
    assert code == 0 and rep["consumers_lost"] == 0, (rep, p.err)


def test_cli_main_twice_in_one_interpreter(go_producer):
    """main() run twice in one process (a test or a wrapper calling it):
    the second run must still end on SIGTERM (the first left signals
    ignored), and the caller gets its handlers back."""
    p1 = go_producer("-size", "64KiB", "-count", "3")
    p2 = go_producer("-size", "64KiB")
    code = textwrap.dedent("""
        import os, signal, sys, threading, json
        from cudashare import __main__ as m
        assert m.main(["consume", "--socket", %r, "--wait", "5"]) == 0
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        sys.exit(m.main(["consume", "--socket", %r, "--wait", "5"]))
    """ % (p1.path, p2.path))
    cli = subprocess.Popen([sys.executable, "-c", code], cwd=PY, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env=dict(os.environ, CUDASHARE_DRIVER="sim"))
    try:
        out, err = cli.communicate(timeout=6)
    except subprocess.TimeoutExpired:
        cli.kill()
        out, err = cli.communicate()
        raise AssertionError("the second main() ignored SIGTERM: still running 5 s after it")
    finally:
        p2.kill(signal.SIGINT)
    assert cli.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["end"] == "signal"


def _cli_entry_patched(p, patch):
    """python -m cudashare consume, through its real entry (runpy), with
    `patch` applied first."""
    code = "import os, signal, sys, threading, runpy\n" + textwrap.dedent(patch) + textwrap.dedent("""
        sys.argv = ["cudashare", "consume", "--socket", %r, "--wait", "5"]
        runpy.run_module("cudashare", run_name="__main__", alter_sys=True)
    """ % p.path)
    return subprocess.run([sys.executable, "-c", code], cwd=PY, capture_output=True, text=True, timeout=30,
                          env=dict(os.environ, CUDASHARE_DRIVER="sim"))


def test_cli_sigterm_after_main_restores_handlers(go_producer):
    """A process group signalled twice, the second SIGTERM landing as main()
    ends: the CLI, whose report said exit 0 and end "signal", must not then
    die of it (main() used to restore the default handler first)."""
    p = go_producer("-size", "64KiB")
    cli = _cli_entry_patched(p, """
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        orig = signal.signal
        def sig(s, h):
            r = orig(s, h)
            if s == signal.SIGINT and h is signal.default_int_handler:
                os.kill(os.getpid(), signal.SIGTERM)  # the group's second SIGTERM
            return r
        signal.signal = sig
    """)
    p.kill(signal.SIGINT)
    assert json.loads(cli.stdout.strip().splitlines()[-1])["end"] == "signal"
    assert cli.returncode == 0, (cli.returncode, cli.stderr[-2000:])


def test_main_off_the_main_thread():
    """main() from a worker thread: signal.signal raises ValueError there."""
    from cudashare import __main__ as m
    r = []

    def f():
        try:
            r.append(m.main(["consume", "--socket", "/nonexistent/cudashare-test.sock"]))
        except BaseException as e:
            r.append(e)
    t = threading.Thread(target=f)
    t.start()
    t.join(10)
    assert r == [m.EXIT_NO_PRODUCER], r


def test_vmm_data_path(go_producer, gobin):
    """Needs the producer's vmm sharing (-sharing vmm)."""
    if not producer_has_sharing(gobin):
        pytest.skip("this producer has no -sharing flag yet: vmm sharing is not there to test")
    p = go_producer("-count", "12", "-size", "64KiB", "-sharing", "vmm")
    with cudashare.connect(p.path, backend="sim", wait=5) as c:
        for l in c:
            with l:
                assert l.handle_kind == 1
                want = l.meta["batch"] % 251 + 1
                assert bytes(l.host()) == bytes([want]) * l.size
    assert p.wait()[1] == 0


def test_cli_connect_failures_are_reported(tmp_path, monkeypatch):
    """Every way connecting fails is a report line with the reason and the
    Go consumer's exit status (internal/app/explain.go), not a traceback:
    a socket path through a file (ENOTDIR: 1), a listener that never
    answers the hello (the handshake's timeout, 5 s: 7, refused), one that
    hangs up mid-frame (4), one that answers garbage (4), one that refuses
    this consumer (7)."""
    from cudashare import __main__ as m
    f = tmp_path / "file"
    f.write_text("")
    silent = str(tmp_path / "silent.sock")
    ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ls.bind(silent)
    ls.listen(1)  # connects land in the backlog; nobody ever answers
    stop = threading.Event()
    threads = []
    socks = []

    def listener(name, answer):
        """A listener that reads the hello and answers with answer (bytes,
        then it hangs up)."""
        path = str(tmp_path / name)
        ls2 = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ls2.bind(path)
        ls2.listen(8)
        socks.append(ls2)

        def serve():
            ls2.settimeout(0.2)
            while not stop.is_set():
                try:
                    conn, _ = ls2.accept()
                except OSError:
                    continue
                try:
                    conn.settimeout(2)
                    conn.recv(4096)
                    conn.sendall(answer)
                except OSError:
                    pass
                conn.close()
        t = threading.Thread(target=serve, daemon=True)
        t.start()
        threads.append(t)
        return path
    cases = [
        (str(f / "cudashare.sock"), m.EXIT_FAILURE, "Not a directory"),
        (silent, m.EXIT_REFUSED, "did not complete the cudashare handshake"),
        # Two bytes of a frame's length, then the end: hung up mid-handshake.
        (listener("hangup.sock", b"\0\0"), m.EXIT_NO_PRODUCER, "hung up during the handshake"),
        # A frame whose body is not msgpack (0xc1 is never used).
        (listener("garbage.sock", b"\0\0\0\1\xc1"), m.EXIT_NO_PRODUCER, "is not a working cudashare producer"),
        # The producer's own refusal (peer_refused, remote).
        (listener("refuses.sock", b"\0\0\0\x06" + bytes([0x93, 0x09, 0x02, 0xa2]) + b"no"), m.EXIT_REFUSED, "no"),
    ]
    try:
        for sock, code, says in cases:
            r = subprocess.run([sys.executable, "-m", "cudashare", "consume", "--socket", sock],
                               cwd=PY, capture_output=True, text=True, timeout=60)
            rep = json.loads(r.stdout.strip().splitlines()[-1])
            assert r.returncode == code and rep["exit"] == code, (sock, r.returncode, rep, r.stderr[-2000:])
            assert says in rep["error"], rep
            assert "Traceback" not in r.stderr, r.stderr[-2000:]
    finally:
        stop.set()
        ls.close()
        for x in socks:
            x.close()
        for t in threads:
            t.join(2)


def test_cli_unknown_driver_exits_3(fake):
    from cudashare import __main__ as m
    f = fake()
    t = f.serve()
    r = subprocess.run([sys.executable, "-m", "cudashare", "consume", "--socket", f.path], cwd=PY,
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, CUDASHARE_DRIVER="bogus"))
    t.join(5)
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == m.EXIT_NO_DRIVER and "bogus" in rep["error"] and "Traceback" not in r.stderr, (rep, r.stderr)


def test_listener_of_another_user_is_refused(fake):
    """PROTOCOL.md section 1: the consumer reads the listener's
    SO_PEERCRED uid and refuses one it does not allow: one peer_refused
    error, then the end, no hello; ProtocolError."""
    f = fake()
    got = []

    def accept():
        f.lsock.settimeout(5)
        f.conn, _ = f.lsock.accept()
        f.conn.settimeout(5)
        got.append(f.recv())
        got.append(f.recv())
    t = threading.Thread(target=accept, daemon=True)
    t.start()
    other = os.geteuid() + 4242
    try:
        cudashare.connect(f.path, backend="sim", allowed_uids=[other])
    except cudashare.ProtocolError as e:
        assert e.code == 2 and not e.remote and "runs as uid %d" % os.geteuid() in str(e), e
    else:
        raise AssertionError("a listener of a user not allowed was accepted")
    t.join(5)
    assert len(got) == 2 and got[0][:2] == [9, 2] and "not allowed" in got[0][2] and got[1] is None, got


def test_no_allowed_uids_means_this_user(fake):
    """allowed_uids=[] is the default (this user), as the Go transport's
    empty AllowedUIDs: not a consumer that refuses everyone."""
    f = fake()
    t = f.serve()
    c = cudashare.connect(f.path, backend="sim", allowed_uids=[])
    t.join(5)
    assert f.hello[0] == 1
    c.close(timeout=0.5)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run the consumer as another user (uid 65534)")
def test_cli_socket_of_another_user_exits_7(tmp_path):
    """A socket in a directory this user may not enter (EACCES): refused,
    exit 7, as the Go consumer."""
    from cudashare import __main__ as m
    d = tempfile.mkdtemp(prefix="cudashare-eacces-")
    os.chmod(d, 0o700)
    path = os.path.join(d, "s")
    ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ls.bind(path)
    ls.listen(1)
    try:
        def drop():
            os.setgid(65534)
            os.setuid(65534)
        env = dict(os.environ, PYTHONPATH=PY, HOME="/tmp")
        if subprocess.run([sys.executable, "-c", "import cudashare"], cwd="/", env=env, preexec_fn=drop,
                          capture_output=True, timeout=60).returncode != 0:
            pytest.skip("uid 65534 cannot read this checkout's python package")
        r = subprocess.run([sys.executable, "-m", "cudashare", "consume", "--socket", path], cwd=PY,
                           capture_output=True, text=True, timeout=60, preexec_fn=drop, env=env)
        rep = json.loads(r.stdout.strip().splitlines()[-1])
        assert r.returncode == m.EXIT_REFUSED and rep["end"] == "refused" and "same user" in rep["error"], (rep, r.stderr)
    finally:
        ls.close()
        os.unlink(path)
        os.rmdir(d)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to listen as another user (uid 65534)")
def test_cli_refuses_a_listener_of_another_user():
    """The CLI's default: only its own user; another's listener is refused
    with exit 7, as the Go consumer does."""
    from cudashare import __main__ as m
    d = tempfile.mkdtemp(prefix="cudashare-uid-")
    os.chmod(d, 0o777)
    path = os.path.join(d, "s")
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, socket, sys
        os.setgid(65534); os.setuid(65534)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(sys.argv[1]); s.listen(1)
        print("listening", flush=True)
        s.settimeout(30)
        c, _ = s.accept()
        c.settimeout(5)
        print(repr(c.recv(4096)), flush=True)
        """), path], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "listening"
        r = subprocess.run([sys.executable, "-m", "cudashare", "consume", "--socket", path], cwd=PY,
                           capture_output=True, text=True, timeout=60)
        rep = json.loads(r.stdout.strip().splitlines()[-1])
        assert r.returncode == m.EXIT_REFUSED and rep["end"] == "refused" and "uid 65534" in rep["error"], (rep, r.stderr)
        assert "not allowed" in child.stdout.readline()  # it was told why
    finally:
        child.kill()
        child.wait()
        for n in os.listdir(d):
            os.unlink(os.path.join(d, n))
        os.rmdir(d)
