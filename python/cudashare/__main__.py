"""python -m cudashare consume --socket PATH: the Go example consumer's
loop in Python, printing the same one-line JSON report (ConsumerReport in
internal/app/report.go), so the benchmark and the integration suite can run
either."""

import argparse
import json
import os
import resource
import signal
import sys
import threading
import time

from . import connect, default_socket_path
from . import _errors as errors
from ._errors import (Closed, CudashareError, DriverError, NotSupported, ProducerGone, ProducerRestarting,
                     ProtocolError, ReconnectDeadline, Timeout)

# The Go consumer's exit statuses (internal/app/common.go), so that scripts
# and the benchmark read both the same way.
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_NO_DRIVER, EXIT_NO_PRODUCER, EXIT_PRODUCER_GONE = 0, 1, 2, 3, 4, 5
EXIT_REFUSED, EXIT_DROPPED, EXIT_RESTARTED = 7, 8, 9


def pattern_byte(batch):
    """The byte of every position of the example producer's batch n
    (PROTOCOL.md §4.2)."""
    return batch % 251 + 1


def _cpu():
    """The process's CPU time so far in seconds, user and system, every
    thread: what the Go consumer's cpu_us_per_handoff counts."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _uuid(b):
    if not b:
        return ""
    h = b.hex()
    return "GPU-%s-%s-%s-%s-%s" % (h[:8], h[8:12], h[12:16], h[16:20], h[20:])


def _flag(v):
    v = v.lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError("want true or false, got %r" % v)


def explain_connect(path, e):
    """(end, error, exit status) for a failure to connect, with the Go
    consumer's statuses (internal/app/explain.go explainDial)."""
    if isinstance(e, (FileNotFoundError, ConnectionRefusedError)):
        return "error", "no producer at %s: %s" % (path, e), EXIT_NO_PRODUCER
    if isinstance(e, PermissionError):
        return "refused", ("cannot reach %s: %s; cudashare only connects processes of the same user: run the "
                           "consumer as the producer's user" % (path, e)), EXIT_REFUSED
    if isinstance(e, (NotSupported, DriverError)):
        return "error", str(e), EXIT_NO_DRIVER
    if isinstance(e, ValueError) and "backend" in str(e):
        return "error", "%s (--driver or CUDASHARE_DRIVER)" % e, EXIT_NO_DRIVER
    if isinstance(e, ProtocolError):
        # Refused at the handshake (another user, a version, a limit, the
        # handshake itself), a listener that is not a working producer
        # (malformed), or anything else that broke it.
        if e.code in (errors.PEER_REFUSED, errors.VERSION, errors.HANDSHAKE) or (e.remote and e.code == errors.LIMIT):
            return "refused", str(e), EXIT_REFUSED
        if e.code == errors.MALFORMED:
            return "error", "%s is not a working cudashare producer: %s" % (path, e), EXIT_NO_PRODUCER
        return "error", "cannot connect to the producer at %s: %s" % (path, e), EXIT_FAILURE
    if isinstance(e, Timeout):
        return "refused", ("the process at %s did not complete the cudashare handshake (%s): it is not a cudashare "
                           "producer, or it is too busy to answer" % (path, e)), EXIT_REFUSED
    if isinstance(e, (ProducerGone, ConnectionResetError, BrokenPipeError)):
        return "error", ("the process at %s hung up during the handshake: it is not a working cudashare producer, "
                         "or it is overloaded (%s)" % (path, e)), EXIT_NO_PRODUCER
    return "error", "cannot connect to the producer at %s: %s" % (path, e), EXIT_FAILURE


def consume(args, out):
    rep = {"role": "consumer", "impl": "cudashare-python", "driver": "", "driver_reason": "", "device": args.device,
           "device_uuid": "", "producer_device": "", "same_device": False, "socket": args.socket,
           "workers": args.workers, "credits": args.credits, "verify": args.verify, "handoffs": 0,
           "seconds": 0.0, "handoffs_per_s": 0.0, "p50_us": 0.0, "p99_us": 0.0, "max_us": 0.0, "cpu_us_per_handoff": 0.0, "bytes": 0,
           "size": 0, "verified": 0, "verify_errors": 0, "errors": 0, "buffers_seen": 0, "mappings": 0,
           "reconnects": 0, "releases_dropped": 0,
           "shm": False, "end": "", "exit": 0}
    # shm: the messages went through the shm channel (PROTOCOL.md
    # 2.3), as the Go consumer's report says (--shm true asks for them).
    lat = []
    seen = set()
    lock = threading.Lock()
    times = [None, None]
    cpu0 = [None]  # the process's CPU time at the first receipt
    try:
        c = connect(args.socket, device=args.device, credits=args.credits, backend=args.driver, wait=args.wait,
                    shm=args.shm, reconnect=args.reconnect or None)
    except KeyboardInterrupt:
        rep.update(end="signal", error="interrupted while connecting to %s" % args.socket, exit=EXIT_FAILURE)
        return rep
    except Exception as e:
        end, err, code = explain_connect(args.socket, e)
        rep.update(end=end, error=err, exit=code)
        return rep
    rep["driver"], rep["driver_reason"] = c.backend, c.backend_reason
    rep["shm"] = c.stats()["shm"]
    rep["device_uuid"] = _uuid(c.device_uuid)
    if c.producer["devices"]:
        rep["producer_device"] = _uuid(c.producer["devices"][0])
    rep["same_device"] = bool(rep["device_uuid"]) and rep["device_uuid"] == rep["producer_device"]

    def handle(lease):
        now = time.monotonic_ns()
        with lock:
            if times[0] is None:
                times[0] = now
                cpu0[0] = _cpu()
        m = lease.meta if isinstance(lease.meta, dict) else {}
        batch, sent = m.get("batch"), m.get("t")
        ok = isinstance(batch, int) and isinstance(sent, int)
        bad = 0
        err = 0
        verified = 0
        if not ok:
            bad = 1
        elif args.verify != "none":
            want = pattern_byte(batch)
            try:
                if args.verify == "byte":
                    got = lease.read(1)
                else:
                    got = lease.read()
                if got.count(want) == len(got):
                    verified = 1
                else:
                    bad = 1
            except NotSupported:
                err = 1
        with lock:
            if ok:
                lat.append(now - sent)
            rep["bytes"] += lease.size
            rep["size"] = lease.size
            rep["verified"] += verified
            rep["verify_errors"] += bad
            rep["errors"] += err
            if len(seen) < 4096:
                seen.add((lease.alloc_id, lease.offset))
        lease.release()
        with lock:
            rep["handoffs"] += 1
            times[1] = time.monotonic_ns()

    err = None
    try:
        c.run(handle, workers=args.workers, count=args.batches)
        rep["end"] = "count" if args.batches and rep["handoffs"] >= args.batches else "producer said goodbye"
    except Closed:
        rep["end"] = "producer said goodbye"
    except ReconnectDeadline as e:
        rep["end"], err = "producer did not come back", (str(e), EXIT_PRODUCER_GONE)
    except ProducerRestarting as e:
        rep["end"], err = "producer restarted", ("%s; run with --reconnect SECONDS to wait for it and go on" % e,
                                                 EXIT_RESTARTED)
    except ProducerGone as e:
        rep["end"], err = "producer vanished", (str(e), EXIT_PRODUCER_GONE)
    except ProtocolError as e:
        # remote: the producer sent the error, and dropped this consumer.
        rep["end"] = "protocol error"
        if e.remote:
            # The Go consumer's words: "dropped: timeout" for code 11.
            rep["end"] = "dropped: timeout" if e.code == errors.TIMEOUT else "dropped"
        err = (str(e), EXIT_DROPPED if e.remote else EXIT_FAILURE)
    except KeyboardInterrupt:
        rep["end"] = "signal"
    finally:
        # From here on a signal no longer interrupts: the goodbye and the
        # report must not be cut short.
        _ending[0] = True
        st = c.stats()
        c.close()
    rep["mappings"] = st.get("mappings", 0)
    rep["reconnects"] = st.get("reconnects", 0)
    rep["releases_dropped"] = st.get("releases_dropped", 0)
    rep["buffers_seen"] = len(seen)
    if times[0] is not None and times[1] is not None and times[1] > times[0]:
        secs = (times[1] - times[0]) / 1e9
        rep["seconds"] = round(secs, 3)
        if rep["handoffs"] > 1:
            rep["handoffs_per_s"] = round(rep["handoffs"] / secs, 1)
    if cpu0[0] is not None and rep["handoffs"]:
        rep["cpu_us_per_handoff"] = round((_cpu() - cpu0[0]) / rep["handoffs"] * 1e6, 1)
    if lat:
        lat.sort()
        rep["p50_us"] = round(lat[len(lat) // 2] / 1e3, 1)
        rep["p99_us"] = round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] / 1e3, 1)
        rep["max_us"] = round(lat[-1] / 1e3, 1)
    if err is None and (rep["verify_errors"] or rep["errors"]):
        err = ("%d batch(es) failed verification and %d could not be read back, of %d"
               % (rep["verify_errors"], rep["errors"], rep["handoffs"]), EXIT_FAILURE)
    if err:
        rep["error"], rep["exit"] = err
    return rep


_ending = [False]  # set once the run ends: later signals are ignored


def _interrupt(signum, frame):
    if _ending[0]:
        return
    # One interrupt ends the run; a second must not cut its end short.
    _ending[0] = True
    raise KeyboardInterrupt("signal %d" % signum)


def main(argv=None, restore_signals=True):
    p = argparse.ArgumentParser(prog="python -m cudashare")
    sub = p.add_subparsers(dest="cmd", required=True)
    cp = sub.add_parser("consume", help="consume a producer's batches and print a JSON report")
    cp.add_argument("--socket", default=default_socket_path())
    cp.add_argument("--batches", type=int, default=0, help="stop after this many (0: until the producer ends)")
    cp.add_argument("--verify", choices=["none", "byte", "full"], default="byte")
    cp.add_argument("--credits", type=int, default=8)
    cp.add_argument("--workers", type=int, default=2)
    cp.add_argument("--device", type=int, default=0)
    cp.add_argument("--driver", choices=["auto", "cuda", "sim"], default="auto")
    cp.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the socket to appear")
    cp.add_argument("--reconnect", type=float, default=0.0, metavar="SECONDS",
                    help="keep going through a producer's restart: when it vanishes (killed, crashed) or restarts "
                         "(its goodbye says it comes back), wait up to SECONDS for a producer at --socket and go on "
                         "with its batches; also wait that long for a first producer (0: off: exit 5 when it "
                         "vanishes, 9 when it restarts; 5 too when none came back within SECONDS)")
    cp.add_argument("--shm", type=_flag, default=None, metavar="true|false",
                    help="carry the messages through two lanes in memory shared with the producer, if it allows "
                         "them, instead of on the socket (as the Go consumer's -shm; default: only with "
                         "CUDASHARE_SHM=1, see cudashare/_shm.py)")
    a = p.parse_args(argv)
    if a.batches < 0 or a.workers < 1 or not 1 <= a.credits <= 1048576 or a.reconnect < 0:
        p.error("--batches >= 0, --workers >= 1, --credits 1 to 1048576, --reconnect >= 0")
    # SIGTERM ends the run as SIGINT does: the leases in hand are released,
    # the mappings closed, goodbye said, and the report printed (exit 0, end
    # "signal"), as the Go consumer does.
    # Only the main thread may set handlers: elsewhere the run goes without.
    own = threading.current_thread() is threading.main_thread()
    if own:
        _ending[0] = False  # a main() run before in this interpreter has set it
        prev = signal.signal(signal.SIGTERM, _interrupt), signal.signal(signal.SIGINT, _interrupt)
    try:
        rep = consume(a, sys.stdout)
        sys.stdout.write(json.dumps(rep, separators=(",", ":")) + "\n")
        if rep.get("error"):
            sys.stderr.write("consumer: %s\n" % rep["error"])
        return rep["exit"]
    finally:
        # A caller that runs main() in its own process gets its handlers back;
        # the CLI does not: a signal between the restore and the exit (a
        # group signalled twice) would kill it after its report said exit 0.
        if own and restore_signals:
            signal.signal(signal.SIGTERM, prev[0])
            signal.signal(signal.SIGINT, prev[1])


if __name__ == "__main__":
    sys.exit(main(restore_signals=False))
