//go:build linux

package transport

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Listener accepts connections on a Unix-domain socket.
//
// It accepts in a goroutine of its own: each connection's credentials are
// checked at once (a refused peer is logged, sent an error message and
// closed), then its handshake runs in a goroutine bounded by
// Config.HandshakeTimeout, so that a slow or silent peer holds up no one.
// Accept returns connections whose handshake succeeded.
//
// It bounds what peers can make it hold, by process (the SO_PEERCRED pid)
// and in all: pending handshakes (Config.MaxHandshakesPerPeer, and
// MaxHandshakes, past which the oldest is evicted so that silent
// connections cannot lock anyone out), and connections from the handshake
// until Conn.Close (MaxConnsPerPeer, MaxConns). A connection past a limit
// is sent an error matching ErrLimit that names the limit, and closed.
type Listener struct {
	cfg      Config
	logLimit *rateLimit // cfg.Logger's limit (ratelog.go)
	ln       *net.UnixListener
	path     string
	ino      uint64 // the socket file's inode: Close removes path only while it is this one
	conns    chan *Conn
	ctx      context.Context // ends with Close
	cancel   context.CancelFunc
	wg       sync.WaitGroup
	once     sync.Once

	mu         sync.Mutex
	pending    []*pendingHandshake // oldest first
	pendingPer map[int32]int
	open       int // connections from their handshake until Conn.Close
	openPer    map[int32]int

	observe   atomic.Pointer[func() []byte] // ServeObservers (observer.go)
	observers atomic.Int32                  // observers served now
}

// pendingHandshake is a connection accepted and not yet handshaken.
type pendingHandshake struct {
	pid     int32
	cancel  context.CancelCauseFunc // evicts it, with the cause to tell
	evicted bool                    // l.mu
}

// Listen listens on the Unix socket at path.
//
// The socket's directory is created with mode 0700 if missing; an existing
// one must be a directory (not a symlink) owned by this user with no
// access for group or others, else Listen fails with ErrUnsafePath. The
// socket file gets mode 0600. A socket file left by a dead listener is
// removed; a live one makes Listen fail with EADDRINUSE; anything else at
// path is left alone and is an ErrUnsafePath.
func Listen(ctx context.Context, path string, cfg Config) (*Listener, error) {
	cfg, err := cfg.resolve()
	if err != nil {
		return nil, err
	}
	if err := privateDir(filepath.Dir(path)); err != nil {
		return nil, fmt.Errorf("transport: listen %s: %w", path, err)
	}
	if err := removeStale(ctx, path); err != nil {
		return nil, fmt.Errorf("transport: listen %s: %w", path, err)
	}
	ln, ino, err := listenAt(path)
	if err != nil {
		return nil, fmt.Errorf("transport: listen %s: %w", path, err)
	}
	// What the listener and its connections log comes from peers, as
	// fast as they connect: limited (ratelog.go).
	var logLimit *rateLimit
	cfg.Logger, logLimit = limitLogger(cfg.Logger)
	l := &Listener{
		cfg:      cfg,
		logLimit: logLimit,
		ln:       ln,
		path:     path,
		ino:      ino,
		conns:    make(chan *Conn),

		pendingPer: make(map[int32]int),
		openPer:    make(map[int32]int),
	}
	l.ctx, l.cancel = context.WithCancel(context.Background())
	l.wg.Add(1)
	go l.acceptLoop()
	return l, nil
}

// listenAt listens on a Unix socket that appears at path only once it
// accepts connections: bound and listening under a temporary name in the
// same directory, mode 0600, then hard-linked to path (which fails if
// anything is there: two listeners never share a path) and the temporary
// name removed. Bound in place, a dialer that finds the file between
// bind(2) and listen(2) is refused (ECONNREFUSED), which a consumer started
// with its producer was seen to hit. ino is the socket file's inode, so
// that Close removes path only while it is still this listener's.
func listenAt(path string) (ln *net.UnixListener, ino uint64, err error) {
	tmp := fmt.Sprintf("%s.%d.tmp", path, os.Getpid())
	if len(tmp) >= len(unix.RawSockaddrUnix{}.Path) {
		tmp = path // too long for a socket address: bind in place
	}
	if tmp != path {
		os.Remove(tmp) // left by a process of this pid that died
	}
	if ln, err = net.ListenUnix("unix", &net.UnixAddr{Name: tmp, Net: "unix"}); err != nil {
		return nil, 0, err
	}
	ln.SetUnlinkOnClose(false) // Close removes path itself, if still ours
	fail := func(err error) (*net.UnixListener, uint64, error) {
		ln.Close()
		os.Remove(tmp)
		return nil, 0, err
	}
	if err := os.Chmod(tmp, 0o600); err != nil {
		return fail(err)
	}
	var st unix.Stat_t
	if err := unix.Stat(tmp, &st); err != nil {
		return fail(err)
	}
	if tmp != path {
		if err := os.Link(tmp, path); err != nil {
			if errors.Is(err, fs.ErrExist) {
				err = fmt.Errorf("%s appeared meanwhile: %w", path, unix.EADDRINUSE)
			}
			return fail(err)
		}
		os.Remove(tmp)
	}
	return ln, st.Ino, nil
}

// privateDir makes sure dir exists and only this user can enter it.
func privateDir(dir string) error {
	if _, err := os.Lstat(dir); errors.Is(err, fs.ErrNotExist) {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return err
		}
		// The umask may have taken bits we need; it cannot have added any.
		if err := os.Chmod(dir, 0o700); err != nil {
			return err
		}
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return err
	}
	if !fi.IsDir() {
		return fmt.Errorf("%w: %s is not a directory (mode %v)", ErrUnsafePath, dir, fi.Mode())
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fmt.Errorf("%w: cannot tell the owner of %s", ErrUnsafePath, dir)
	}
	if euid := os.Geteuid(); st.Uid != uint32(euid) {
		return fmt.Errorf("%w: %s is owned by uid %d, not uid %d", ErrUnsafePath, dir, st.Uid, euid)
	}
	if perm := fi.Mode().Perm(); perm&0o077 != 0 {
		return fmt.Errorf("%w: %s has mode %#o: group or others can enter it (want 0700)", ErrUnsafePath, dir, perm)
	}
	return nil
}

// removeStale removes a socket file at path that no one listens on.
func removeStale(ctx context.Context, path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("%w: %s exists and is not a socket", ErrUnsafePath, path)
	}
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", path)
	if err == nil {
		nc.Close()
		return fmt.Errorf("a listener is live: %w", unix.EADDRINUSE)
	}
	if !errors.Is(err, unix.ECONNREFUSED) {
		return err
	}
	return os.Remove(path)
}

// Addr returns the socket's path.
func (l *Listener) Addr() string { return l.path }

// peerLogger returns Config.Logger as the listener writes to it: limited
// to a burst, then one record a second, counting what it held back
// (ratelog.go). A user of the listener's connections logs there what
// their peers cause, which comes as fast as peers connect. Once the
// listener is closed, every record passes.
func (l *Listener) peerLogger() *slog.Logger { return l.cfg.Logger }

// Accept returns the next connection whose credentials and handshake
// passed.
func (l *Listener) Accept(ctx context.Context) (*Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-l.ctx.Done():
		return nil, fmt.Errorf("transport: listener %s: %w", l.path, ErrClosed)
	}
}

// Close stops listening, removes the socket file, and closes the
// connections not yet returned by Accept. It is idempotent and returns nil.
func (l *Listener) Close() error {
	l.once.Do(func() {
		l.cancel()
		var st unix.Stat_t
		if unix.Stat(l.path, &st) == nil && st.Ino == l.ino {
			os.Remove(l.path) // before the close: no dialer is refused at a live-looking path
		}
		l.ln.Close()
		l.wg.Wait()
		l.logLimit.close()
	})
	return nil
}

func (l *Listener) acceptLoop() {
	defer l.wg.Done()
	var delay time.Duration
	for {
		nc, err := l.ln.AcceptUnix()
		if err != nil {
			if l.ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of descriptors, say: back off, as net/http does.
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			l.cfg.Logger.Warn("transport: accept failed", "path", l.path, "err", err, "retry_in", delay)
			t := time.NewTimer(delay)
			select {
			case <-t.C:
			case <-l.ctx.Done():
				t.Stop()
				return
			}
			continue
		}
		delay = 0
		l.admit(nc)
	}
}

// admit checks a new connection's credentials and the limits, and starts
// its handshake.
func (l *Listener) admit(nc *net.UnixConn) {
	cred, err := checkPeer(nc, &l.cfg, "listener "+l.path)
	if err != nil {
		nc.Close()
		return
	}
	l.mu.Lock()
	err = l.checkOpenLocked(cred.Pid)
	if _, lim := l.cfg.peerLimits(cred.Pid); err == nil && l.pendingPer[cred.Pid] >= lim {
		err = fmt.Errorf("%w: %s %d handshakes pending at listener %s: limit %s=%d",
			ErrLimit, peerName(cred.Pid), l.pendingPer[cred.Pid], l.path, limitName(cred.Pid, "MaxHandshakes"), lim)
	}
	if err != nil {
		l.mu.Unlock()
		refuse(nc, &l.cfg, cred, err)
		return
	}
	var evict *pendingHandshake
	if len(l.pending) >= l.cfg.MaxHandshakes {
		// Evict the oldest rather than refuse the newest: a peer that
		// handshakes at once then always gets in, however many silent
		// connections strangers keep open.
		evict = l.pending[0]
		l.removePendingLocked(evict)
		evict.evicted = true
	}
	ctx, cancel := context.WithCancelCause(l.ctx)
	hs := &pendingHandshake{pid: cred.Pid, cancel: cancel}
	l.pending = append(l.pending, hs)
	l.pendingPer[hs.pid]++
	l.mu.Unlock()
	if evict != nil {
		l.cfg.Logger.Warn("transport: too many pending handshakes, evicting the oldest",
			"path", l.path, "pid", evict.pid, "limit", l.cfg.MaxHandshakes)
		evict.cancel(fmt.Errorf("%w: %d handshakes pending at listener %s, the oldest is dropped: limit MaxHandshakes=%d",
			ErrLimit, l.cfg.MaxHandshakes, l.path, l.cfg.MaxHandshakes))
	}
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		defer cancel(nil)
		c, err := newConn(nc, l.cfg, cred)
		if err != nil {
			l.donePending(hs)
			nc.Close()
			return
		}
		err = c.handshake(ctx, false, func(c *Conn) error {
			if err := l.reserve(hs, c); err != nil {
				return err
			}
			return l.admitObserver(c)
		})
		l.donePending(hs)
		if err != nil {
			c.Close()
			if l.ctx.Err() == nil {
				l.cfg.Logger.Warn("transport: handshake failed", "path", l.path, "err", err)
			}
			return
		}
		if c.peer.Role == RoleObserver {
			l.wg.Add(1)
			go l.serveObserver(c)
			return
		}
		select {
		case l.conns <- c:
		case <-l.ctx.Done():
			c.Close()
		}
	}()
}

// checkOpenLocked returns an error matching ErrLimit if pid may not open
// another connection.
func (l *Listener) checkOpenLocked(pid int32) error {
	if n, lim := l.openPer[pid], l.cfg.connLimit(pid); n >= lim {
		return fmt.Errorf("%w: %s %d connections to listener %s: limit %s=%d",
			ErrLimit, peerName(pid), n, l.path, limitName(pid, "MaxConns"), lim)
	}
	if l.open >= l.cfg.MaxConns {
		return fmt.Errorf("%w: listener %s has %d connections: limit MaxConns=%d",
			ErrLimit, l.path, l.open, l.cfg.MaxConns)
	}
	return nil
}

// peerLimits returns the most connections and pending handshakes the
// peer process pid (its SO_PEERCRED pid) may have at a listener. A pid
// that reads 0 is a process in a PID namespace this one cannot see
// (another container; PROTOCOL.md sections 3 and 4.1). Such peers cannot
// be told apart, so they share one bucket, sized for many processes: half
// of the listener's limits (no less than one peer's), which leaves the
// other half to the peers that can be told apart. Counted as one process,
// all the other containers together could hold 8 pending handshakes and
// 64 connections.
func (c *Config) peerLimits(pid int32) (conns, handshakes int) {
	if pid != 0 {
		return c.MaxConnsPerPeer, c.MaxHandshakesPerPeer
	}
	return max(c.MaxConnsPerPeer, c.MaxConns/2), max(c.MaxHandshakesPerPeer, c.MaxHandshakes/2)
}

func (c *Config) connLimit(pid int32) int {
	n, _ := c.peerLimits(pid)
	return n
}

// peerName and limitName word a limit's refusal for pid.
func peerName(pid int32) string {
	if pid == 0 {
		return "the peers in other PID namespaces (pid 0, counted together) have"
	}
	return fmt.Sprintf("pid %d has", pid)
}

func limitName(pid int32, what string) string {
	if pid == 0 {
		return "max(" + what + "PerPeer, " + what + "/2)"
	}
	return what + "PerPeer"
}

// reserve counts c, whose peer's hello has arrived, against the
// connection limits before it is answered, until c is closed; or returns
// why not.
func (l *Listener) reserve(hs *pendingHandshake, c *Conn) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if hs.evicted {
		return fmt.Errorf("%w: evicted from the pending handshakes of listener %s: limit MaxHandshakes=%d",
			ErrLimit, l.path, l.cfg.MaxHandshakes)
	}
	l.removePendingLocked(hs)
	if err := l.checkOpenLocked(hs.pid); err != nil {
		return err
	}
	l.open++
	l.openPer[hs.pid]++
	pid := hs.pid
	c.onClose = func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.open--
		if l.openPer[pid]--; l.openPer[pid] == 0 {
			delete(l.openPer, pid)
		}
	}
	return nil
}

// donePending forgets hs, if it is still pending.
func (l *Listener) donePending(hs *pendingHandshake) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.removePendingLocked(hs)
}

func (l *Listener) removePendingLocked(hs *pendingHandshake) {
	i := slices.Index(l.pending, hs)
	if i < 0 {
		return
	}
	l.pending = slices.Delete(l.pending, i, i+1)
	if l.pendingPer[hs.pid]--; l.pendingPer[hs.pid] == 0 {
		delete(l.pendingPer, hs.pid)
	}
}

// refuse logs the refusal of a new connection for err, tells the peer and
// closes the connection.
func refuse(nc *net.UnixConn, cfg *Config, cred *unix.Ucred, err error) {
	cfg.Logger.Warn("transport: refused connection", "uid", cred.Uid, "pid", cred.Pid, "err", err)
	tell(nc, nil, codeOf(err), err.Error())
	nc.Close()
}

// tell sends an error message to a peer about to be dropped, on a
// best-effort basis: a new connection's socket has room for it, and one
// that does not read gets errorWriteTimeout at most.
// pre, if any, goes first.
func tell(nc *net.UnixConn, pre []byte, code uint32, text string) {
	nc.SetWriteDeadline(time.Now().Add(errorWriteTimeout))
	nc.Write(appendError(pre, code, text))
}

// checkPeer reads the peer's credentials and refuses a peer whose user is
// not allowed: it logs, sends an error message and returns an error
// matching ErrPeerRefused. The caller closes nc on error.
func checkPeer(nc *net.UnixConn, cfg *Config, where string) (*unix.Ucred, error) {
	cred, err := peerCred(nc)
	if err != nil {
		cfg.Logger.Warn("transport: cannot read peer credentials", "at", where, "err", err)
		return nil, err
	}
	if slices.Contains(cfg.AllowedUIDs, cred.Uid) {
		return cred, nil
	}
	cfg.Logger.Warn("transport: refused peer", "at", where,
		"uid", cred.Uid, "gid", cred.Gid, "pid", cred.Pid, "allowed_uids", cfg.AllowedUIDs)
	text := fmt.Sprintf("uid %d is not allowed by %s", cred.Uid, where)
	tell(nc, nil, codePeerRefused, text)
	return nil, fmt.Errorf("%w: pid %d uid %d: %s", ErrPeerRefused, cred.Pid, cred.Uid, text)
}
