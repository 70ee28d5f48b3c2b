//go:build linux

package share_test

import (
	"errors"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/share"
	"github.com/seed743c36cf/cudashare/transport"
)

// TestObserverSeesHolder: an observer on the exporter's socket sees the
// consumer that holds leases (its pid, leases, bytes, the oldest lease's
// buffer), is not counted as a consumer, and the exporter logs the holder
// once its leases pass the warning threshold, once per lease.
func TestObserverSeesHolder(t *testing.T) {
	env := sharetest.Setup(t)
	var log sharetest.SyncBuffer
	e, err := share.NewExporter(sharetest.Ctx(t), env.Ctx, sharetest.SocketPath(t), share.ExporterConfig{
		Logger:       slog.New(slog.NewTextHandler(&log, nil)),
		LeaseTimeout: time.Hour, LeaseWarn: time.Nanosecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	c := startConsumer(t, e, sharetest.EnvParam(sharetest.ParamHold, 2))
	if err := e.WaitConsumers(sharetest.Ctx(t), 1); err != nil {
		t.Fatal(err)
	}
	r, err := e.NewRing(4, 4096)
	if err != nil {
		t.Fatal(err)
	}
	offerRing(t, env, e, r, 0, 2)
	c.Expect("HELD")

	ctx := sharetest.Ctx(t)
	o, err := share.Observe(ctx, e.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	s, err := o.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if s.PID != os.Getpid() || s.Stats.Consumers != 1 || len(s.Consumers) != 1 || e.Consumers() != 1 {
		t.Fatalf("snapshot: pid %d, %d consumers counted, %d listed (exporter: %d); want this pid and the one consumer",
			s.PID, s.Stats.Consumers, len(s.Consumers), e.Consumers())
	}
	cs := s.Consumers[0]
	if cs.PID != int32(c.Pid()) || cs.Leases != 2 || cs.LeasedBytes != 2*4096 || cs.Offers != 2 || cs.Releases != 0 ||
		cs.OldestLease <= 0 || cs.OldestSize != 4096 || cs.State != "active" || cs.Comm == "" || cs.OtherPIDNamespace {
		t.Errorf("consumer %+v: want pid %d holding 2 leases of 4096 bytes, an oldest lease of some age", cs, c.Pid())
	}
	if s.LeaseAges.Count != 2 || len(s.Rings) != 1 || s.Rings[0].Leased != 2 {
		t.Errorf("lease ages %+v, rings %+v", s.LeaseAges, s.Rings)
	}
	// The warning comes on the janitor's next tick (an hour / 8 is too
	// long to wait: LeaseWarn is checked on ticks). Ask for it directly.
	share.WarnHeld(e)
	share.WarnHeld(e)
	if n := strings.Count(log.String(), "past the warning threshold"); n != 1 ||
		!strings.Contains(log.String(), "more_leases_past_threshold=1") {
		t.Errorf("%d warnings, want 1 naming both leases:\n%s", n, log.String())
	}
	c.Send("release")
	shutdown(t, e)
	c.Wait()
	if h := e.Snapshot().Handoff; h.Count != 2 {
		t.Errorf("handoff histogram counted %d releases, want 2", h.Count)
	}
}

// TestObserverBounds: observers past MaxObservers are refused with a
// limit error, a request that is not a snapshot-request ends the
// observer, and a consumer keeps being served meanwhile.
func TestObserverBounds(t *testing.T) {
	env := sharetest.Setup(t)
	e := newExporter(t, env)
	ctx := sharetest.Ctx(t)
	var obs []*share.Observer
	for range transport.MaxObservers {
		o, err := share.Observe(ctx, e.Addr())
		if err != nil {
			t.Fatal(err)
		}
		defer o.Close()
		obs = append(obs, o)
	}
	if _, err := share.Observe(ctx, e.Addr()); !errors.Is(err, transport.ErrLimit) {
		t.Fatalf("observer %d: %v, want ErrLimit", transport.MaxObservers+1, err)
	}
	obs[0].Close()
	var err error
	// Its place comes back once the producer sees the close.
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		var o *share.Observer
		if o, err = share.Observe(ctx, e.Addr()); err == nil {
			o.Close()
			break
		}
	}
	if err != nil {
		t.Fatalf("an observer's place did not come back: %v", err)
	}
	if s, err := obs[1].Snapshot(ctx); err != nil || s.Stats.Consumers != 0 || len(s.Consumers) != 0 {
		t.Errorf("snapshot %+v, %v: observers listed as consumers", s, err)
	}
}
