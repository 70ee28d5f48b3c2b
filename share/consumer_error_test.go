//go:build linux

package share_test

import (
	"errors"
	"log/slog"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/internal/testutil"
	"github.com/seed743c36cf/cudashare/share"
	"github.com/seed743c36cf/cudashare/transport"
)

// TestConsumerErrorLogged: a consumer that leaves with an error message of
// its own (here code 10, internal, what PROTOCOL.md section 4.1 tells one
// that cannot import an allocation to send) has the producer's log say
// who, the code and the consumer's text, and is counted in
// ExporterStats.ConsumersFailed: else an operator cannot see why it left.
func TestConsumerErrorLogged(t *testing.T) {
	env := sharetest.Setup(t)
	log := &testutil.SyncBuffer{}
	ctx := sharetest.Ctx(t)
	e, err := share.NewExporter(ctx, env.Ctx, sharetest.SocketPath(t), share.ExporterConfig{
		Logger: slog.New(slog.NewTextHandler(log, nil)), // Info: the default level, not -v's
	})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	conn, m := offerOne(t, e)
	defer conn.Close()
	// What the Go consumer does when an import fails: release, then say
	// why (here it ends the connection with it, as the Python one does).
	if err := conn.SendRelease(ctx, m.Offer.Seq); err != nil {
		t.Fatal(err)
	}
	const why = "cannot import allocation: CUDA_ERROR_OUT_OF_MEMORY"
	if err := conn.CloseWithError(errors.New(why)); err != nil {
		t.Fatal(err)
	}

	waitUntil(t, "the consumer's error in the producer's log", func() bool { return strings.Contains(log.String(), why) })
	var line string
	for l := range strings.Lines(log.String()) {
		if strings.Contains(l, why) {
			line = l
		}
	}
	for _, want := range []string{"level=WARN", "consumer pid ", "code=10"} {
		if !strings.Contains(line, want) {
			t.Errorf("the log line lacks %q: %s", want, line)
		}
	}
	waitUntil(t, "ConsumersFailed", func() bool { return e.Stats().ConsumersFailed == 1 })
	if st := e.Stats(); st.ConsumersDropped != 0 {
		t.Errorf("ConsumersDropped %d: the consumer left by itself", st.ConsumersDropped)
	}
}

// TestUnopenableReleaseEvent: a release whose event the producer cannot
// open is malformed (code 3), as PROTOCOL.md section 4 (release) says: the
// producer could not honour the order it asks for. The consumer is told so
// and dropped.
func TestUnopenableReleaseEvent(t *testing.T) {
	env := sharetest.Setup(t)
	ctx := sharetest.Ctx(t)
	e := newExporterWith(t, env, share.ExporterConfig{})
	defer e.Close() // before the leak check dialIn arms
	conn, m := offerOne(t, e)
	defer conn.Close()
	var bogus transport.Handle
	for i := range bogus {
		bogus[i] = byte(i*7 + 1) // no event's handle
	}
	if err := conn.SendReleaseAfter(ctx, bogus, m.Offer.Seq); err != nil {
		t.Fatal(err)
	}
	var err error
	for err == nil {
		err = conn.Recv(ctx, &m)
	}
	var remote *transport.RemoteError
	if !errors.As(err, &remote) || remote.Code != 3 || !errors.Is(err, transport.ErrMalformed) {
		t.Fatalf("after a release with an event that cannot be opened: %v; want the producer's error code 3 (malformed)", err)
	}
	if !strings.Contains(remote.Message, "release event") {
		t.Errorf("the error does not say what was wrong: %q", remote.Message)
	}
	waitUntil(t, "the consumer dropped", func() bool { return e.Stats().ConsumersDropped == 1 })
}

// offerOne connects a raw consumer with one credit to e, offers it one
// buffer of a new ring and returns the connection and the offer it
// received (its descriptors closed).
func offerOne(t *testing.T, e *share.Exporter) (*transport.Conn, transport.Message) {
	t.Helper()
	ctx := sharetest.Ctx(t)
	r, err := e.NewRing(1, 256)
	if err != nil {
		t.Fatal(err)
	}
	conn := dialIn(t, e, 1, false)
	b, err := r.Acquire(ctx)
	if err != nil {
		conn.Close()
		t.Fatal(err)
	}
	if err := e.Offer(ctx, b, share.OfferOptions{}); err != nil {
		conn.Close()
		t.Fatal(err)
	}
	var m transport.Message
	if err := conn.Recv(ctx, &m); err != nil || m.Kind != transport.KindOffer {
		conn.Close()
		t.Fatalf("Recv: %v, %v; want an offer", err, m.Kind)
	}
	for _, fd := range m.Offer.FDs {
		unix.Close(fd)
	}
	return conn, m
}
