//go:build linux

package transport

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/seed743c36cf/cudashare/internal/testutil"
)

// readLimitError reads the error message a refused connection gets and
// checks its code and that its text names want.
func readLimitError(t *testing.T, c net.Conn, want string) {
	t.Helper()
	p := &rawPeer{t: t, c: c.(*net.UnixConn)}
	m, err := p.recv()
	if err != nil {
		t.Fatalf("refused connection: read %v, want an error message", err)
	}
	if len(m) < 3 || m[0] != uint64(KindError) || m[1] != uint64(codeLimit) {
		t.Fatalf("refused connection got %v, want an error message with code %d", m, codeLimit)
	}
	if text, _ := m[2].(string); !strings.Contains(text, want) {
		t.Fatalf("error message %q does not name the limit %s", text, want)
	}
}

// TestSilentConnectionsDoNotLockOut opens more silent connections than
// the listener used to allow pending in all, from several processes, and
// proves that a consumer that dials after them still completes its
// handshake.
func TestSilentConnectionsDoNotLockOut(t *testing.T) {
	cfg := testConfig(RoleProducer, nil)
	cfg.HandshakeTimeout = time.Minute // the silent ones stay pending throughout
	l := listen(t, cfg)
	var hs []*helper
	for range 5 {
		hs = append(hs, startHelper(t, "silent", l.Addr(), []string{helperConns + "=10"}, nil, ""))
	}
	// Connected, so queued for accept ahead of the dial below.
	for _, h := range hs {
		h.waitOutput(t, "ready")
	}
	ctx := testCtx(t)
	c, err := Dial(ctx, l.Addr(), testConfig(RoleConsumer, nil))
	if err != nil {
		t.Fatalf("Dial behind 50 silent connections: %v", err)
	}
	defer c.Close()
	a, err := l.Accept(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
}

// TestRefusedHandshakeTold opens more silent connections from one process
// than the listener keeps pending for it: the listener tells the ones it
// refuses why, and a Dial from that process gets an error matching
// ErrLimit from the listener that names the limit.
func TestRefusedHandshakeTold(t *testing.T) {
	cfg := testConfig(RoleProducer, nil)
	cfg.HandshakeTimeout = time.Minute
	l := listen(t, cfg)
	var silent []net.Conn
	for range 40 {
		silent = append(silent, rawDial(t, l.Addr()).c)
	}
	readLimitError(t, silent[len(silent)-1], "MaxHandshakesPerPeer")
	_, err := Dial(testCtx(t), l.Addr(), testConfig(RoleConsumer, nil))
	var remote *RemoteError
	if !errors.Is(err, ErrLimit) || !errors.As(err, &remote) || !strings.Contains(err.Error(), "MaxHandshakesPerPeer") {
		t.Fatalf("Dial with the process's pending handshakes at the limit: %v, want ErrLimit from the listener naming MaxHandshakesPerPeer", err)
	}
}

// TestPendingHandshakeEviction fills the listener's pending handshakes
// from several processes: the oldest are evicted, and told why, rather
// than the newest refused, so a consumer that dials last gets in.
func TestPendingHandshakeEviction(t *testing.T) {
	cfg := testConfig(RoleProducer, nil)
	cfg.HandshakeTimeout = time.Minute
	cfg.MaxHandshakes = 4
	cfg.MaxHandshakesPerPeer = 2
	l := listen(t, cfg)
	oldest := []net.Conn{rawDial(t, l.Addr()).c, rawDial(t, l.Addr()).c}
	for range 2 {
		startHelper(t, "silent", l.Addr(), []string{helperConns + "=2"}, nil, "").waitOutput(t, "ready")
	}
	ctx := testCtx(t)
	c, err := Dial(ctx, l.Addr(), testConfig(RoleConsumer, nil))
	if err != nil {
		t.Fatalf("Dial with the pending handshakes full: %v", err)
	}
	defer c.Close()
	a, err := l.Accept(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	for _, o := range oldest {
		readLimitError(t, o, "MaxHandshakes=")
	}
}

// TestConnLimits proves a listener holds at most MaxConnsPerPeer
// connections from one process and MaxConns in all, counts a connection
// until it is closed, and tells a refused peer which limit it hit.
func TestConnLimits(t *testing.T) {
	cfg := testConfig(RoleProducer, nil)
	cfg.MaxConnsPerPeer = 3
	cfg.MaxConns = 5
	l := listen(t, cfg)
	ctx := testCtx(t)
	var accepted []*Conn
	dial := func() error {
		t.Helper()
		c, err := Dial(ctx, l.Addr(), testConfig(RoleConsumer, nil))
		if err != nil {
			return err
		}
		t.Cleanup(func() { c.Close() })
		a, err := l.Accept(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { a.Close() })
		accepted = append(accepted, a)
		return nil
	}
	for i := range 3 {
		if err := dial(); err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
	}
	var remote *RemoteError
	err := dial()
	if !errors.Is(err, ErrLimit) || !errors.As(err, &remote) || !strings.Contains(err.Error(), "MaxConnsPerPeer") {
		t.Fatalf("connection past MaxConnsPerPeer: %v, want ErrLimit from the listener naming MaxConnsPerPeer", err)
	}
	// A closed connection no longer counts.
	accepted[0].Close()
	if err := dial(); err != nil {
		t.Fatalf("connection after one closed: %v", err)
	}
	// Two more processes bring the total to MaxConns; a third is refused.
	for range 2 {
		startHelper(t, "consumer", l.Addr(), nil, nil, "")
		a, err := l.Accept(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { a.Close() })
	}
	h := startHelper(t, "limited", l.Addr(), nil, nil, "")
	if err := h.wait(); err != nil || !strings.Contains(h.out.String(), "MaxConns=") {
		t.Fatalf("dial past MaxConns: %v\nhelper: %s", err, h.out.String())
	}
}

// TestConfigLimits proves the limits' defaults, that they stay within
// half of RLIMIT_NOFILE, and that invalid ones are refused.
func TestConfigLimits(t *testing.T) {
	cfg, err := Config{Role: RoleProducer}.resolve()
	if err != nil {
		t.Fatal(err)
	}
	budget := descriptorLimit() / 2
	if budget > 0 && cfg.MaxConns+cfg.MaxHandshakes > budget {
		t.Errorf("default MaxConns %d and MaxHandshakes %d exceed half of RLIMIT_NOFILE (%d)", cfg.MaxConns, cfg.MaxHandshakes, 2*budget)
	}
	if budget >= 1024+256 && (cfg.MaxConns != 1024 || cfg.MaxHandshakes != 256) {
		t.Errorf("defaults MaxConns %d, MaxHandshakes %d; want 1024 and 256", cfg.MaxConns, cfg.MaxHandshakes)
	}
	if cfg.MaxConnsPerPeer != 64 || cfg.MaxHandshakesPerPeer != 8 || cfg.FrameTimeout != 10*time.Second {
		t.Errorf("defaults MaxConnsPerPeer %d, MaxHandshakesPerPeer %d, FrameTimeout %v", cfg.MaxConnsPerPeer, cfg.MaxHandshakesPerPeer, cfg.FrameTimeout)
	}
	bad := map[string]Config{
		"negative MaxConns":             {Role: RoleProducer, MaxConns: -1},
		"negative MaxConnsPerPeer":      {Role: RoleProducer, MaxConnsPerPeer: -1},
		"negative MaxHandshakes":        {Role: RoleProducer, MaxHandshakes: -1},
		"negative MaxHandshakesPerPeer": {Role: RoleProducer, MaxHandshakesPerPeer: -1},
		"negative FrameTimeout":         {Role: RoleProducer, FrameTimeout: -1},
	}
	if budget > 0 {
		bad["MaxConns past RLIMIT_NOFILE"] = Config{Role: RoleProducer, MaxConns: 2 * budget}
	}
	for name, cfg := range bad {
		if _, err := cfg.resolve(); err == nil {
			t.Errorf("%s: resolve accepted the config", name)
		}
	}
}

// otherNamespacePeers makes every peer this process sees read pid 0, as
// peers in a PID namespace it cannot see (another container) do, until the
// test ends. Tests that call it must not run in parallel.
func otherNamespacePeers(t *testing.T) {
	t.Helper()
	prev := peerCred
	peerCred = func(c *net.UnixConn) (*unix.Ucred, error) {
		cred, err := prev(c)
		if err == nil {
			cred.Pid = 0
		}
		return cred, err
	}
	t.Cleanup(func() { peerCred = prev })
}

// TestOtherNamespacePeersShareHalf: peers whose pid reads 0 cannot be told
// apart, so they share one bucket, but one of half the listener's limits,
// not one process's: a ninth handshake or a 65th connection from all the
// other containers together is not refused, and the refusal, when it
// comes, says why.
func TestOtherNamespacePeersShareHalf(t *testing.T) {
	otherNamespacePeers(t)
	cfg := testConfig(RoleProducer, nil)
	cfg.HandshakeTimeout = time.Minute
	cfg.MaxConnsPerPeer = 2
	cfg.MaxConns = 8
	cfg.MaxHandshakesPerPeer = 1
	cfg.MaxHandshakes = 6
	l := listen(t, cfg)
	ctx := testCtx(t)

	// Handshakes: 3 (MaxHandshakes/2) may wait, not 1.
	var silent []net.Conn
	for range 4 {
		silent = append(silent, rawDial(t, l.Addr()).c)
	}
	readLimitError(t, silent[3], "max(MaxHandshakesPerPeer, MaxHandshakes/2)=3")
	for _, c := range silent {
		c.Close()
	}

	// Connections: 4 (MaxConns/2), not 2.
	dial := func() error {
		t.Helper()
		var c *Conn
		var err error
		// The silent connections' pending handshakes end when the
		// listener sees them closed: retry a refusal that names them.
		for range 100 {
			c, err = Dial(ctx, l.Addr(), testConfig(RoleConsumer, nil))
			if err == nil || !strings.Contains(err.Error(), "handshakes pending") {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		if err != nil {
			return err
		}
		t.Cleanup(func() { c.Close() })
		a, err := l.Accept(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { a.Close() })
		return nil
	}
	for i := range 4 {
		if err := dial(); err != nil {
			t.Fatalf("connection %d from other namespaces: %v", i, err)
		}
	}
	err := dial()
	if !errors.Is(err, ErrLimit) || !strings.Contains(err.Error(), "other PID namespaces") ||
		!strings.Contains(err.Error(), "max(MaxConnsPerPeer, MaxConns/2)=4") {
		t.Fatalf("connection past the other namespaces' bucket: %v, want ErrLimit naming it", err)
	}
}

// TestRefusalsLogLimited refuses a flood of connections from one process:
// every one is told why, but the listener's log gets a burst of warnings
// and then about one a second, not one per connection.
func TestRefusalsLogLimited(t *testing.T) {
	log := &testutil.SyncBuffer{}
	cfg := testConfig(RoleProducer, log)
	cfg.HandshakeTimeout = time.Minute
	cfg.MaxHandshakesPerPeer = 2
	l := listen(t, cfg)
	start := time.Now()
	var keep []net.Conn
	for range 2 {
		keep = append(keep, rawDial(t, l.Addr()).c) // pending: the rest are refused
	}
	const flood = 300
	for range flood {
		c := rawDial(t, l.Addr()).c
		readLimitError(t, c, "MaxHandshakesPerPeer")
		c.Close()
	}
	refused := strings.Count(log.String(), "refused connection")
	if most := logBurst + 1 + int(time.Since(start).Seconds())*logPerSecond; refused == 0 || refused > most {
		t.Fatalf("%d refusals logged %d warnings, want 1 to %d", flood, refused, most)
	}
	for _, c := range keep {
		c.Close()
	}
	// What was held back is counted by the time the listener is closed.
	l.Close()
	if !strings.Contains(log.String(), "suppressed=") {
		t.Fatalf("the records held back are counted nowhere:\n%s", log.String())
	}
}

// TestRateLimit: a burst passes, then one a second, and the record that
// passes after some were held back says how many.
func TestRateLimit(t *testing.T) {
	var out bytes.Buffer
	lg, lim := limitLogger(slog.New(slog.NewTextHandler(&out, nil)))
	defer lim.close()
	h := lg.Handler()
	t0 := time.Date(2026, 11, 26, 0, 0, 0, 0, time.UTC)
	emit := func(at time.Time, msg string) {
		if err := h.Handle(context.Background(), slog.NewRecord(at, slog.LevelWarn, msg, 0)); err != nil {
			t.Fatal(err)
		}
	}
	for i := range logBurst + 50 {
		emit(t0.Add(time.Duration(i)*time.Millisecond), "flood")
	}
	if n := strings.Count(out.String(), "msg=flood"); n != logBurst {
		t.Fatalf("%d records within 70 ms passed %d, want the burst, %d", logBurst+50, n, logBurst)
	}
	emit(t0.Add(2*time.Second), "later")
	if !strings.Contains(out.String(), "msg=later suppressed=50") {
		t.Fatalf("the record after 50 held back does not say so:\n%s", out.String())
	}
	// A copy with attributes shares the limit.
	out.Reset()
	h2 := h.WithAttrs([]slog.Attr{slog.String("k", "v")})
	for i := range 5 {
		at := t0.Add(2500*time.Millisecond + time.Duration(i)*time.Millisecond)
		if err := h2.Handle(context.Background(), slog.NewRecord(at, slog.LevelWarn, "copy", 0)); err != nil {
			t.Fatal(err)
		}
	}
	if n := strings.Count(out.String(), "msg=copy"); n != 1 {
		t.Fatalf("a copy with attributes passed %d records with one and a half tokens left, want 1:\n%s", n, out.String())
	}
	// No record comes after the 4 held back: closing the limit says so.
	lim.close()
	if !strings.Contains(out.String(), "held back") || !strings.Contains(out.String(), "suppressed=4") {
		t.Fatalf("closing the limit does not count the 4 records held back:\n%s", out.String())
	}
}
