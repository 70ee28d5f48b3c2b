//go:build linux

package share_test

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/share"
)

// TestLeaseWarnWithoutLeaseTimeout: a producer with no lease timeout
// (LeaseTimeout negative) still names a consumer holding leases past
// LeaseWarn in its log: it is the producer that most needs the warning,
// since nothing else will ever end the hold.
func TestLeaseWarnWithoutLeaseTimeout(t *testing.T) {
	env := sharetest.Setup(t)
	var log sharetest.SyncBuffer
	e, err := share.NewExporter(sharetest.Ctx(t), env.Ctx, sharetest.SocketPath(t), share.ExporterConfig{
		Logger:       slog.New(slog.NewTextHandler(&log, nil)),
		LeaseTimeout: -1, LeaseWarn: 20 * time.Millisecond,
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
	// Behaviour, not timing: the warning comes, whenever it comes (20 s
	// is only how long a loaded machine may take).
	for end := time.Now().Add(20 * time.Second); !strings.Contains(log.String(), "past the warning threshold"); {
		if time.Now().After(end) {
			t.Fatalf("no warning 20 s after two leases passed LeaseWarn (20ms), with no lease timeout:\n%s", log.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	c.Send("release")
	shutdown(t, e)
	c.Wait()
}
