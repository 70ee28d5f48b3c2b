//go:build linux

package share_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/internal/testutil"
	"github.com/seed743c36cf/cudashare/share"
)

// TestPinnedWarned: with legacy IPC, a consumer lost without a goodbye
// keeps what it holds until its process (here, this one) exits. Holding
// the whole ring, or everything in use of an arena an Alloc waits on, it
// makes the producer wait for good: the lease janitor says so, naming it,
// and the wait goes on (it is not an error).
func TestPinnedWarned(t *testing.T) {
	for _, kind := range []string{"ring", "arena"} {
		t.Run(kind, func(t *testing.T) {
			env := sharetest.Setup(t)
			log := &testutil.SyncBuffer{}
			ctx := sharetest.Ctx(t)
			e, err := share.NewExporter(ctx, env.Ctx, sharetest.SocketPath(t), share.ExporterConfig{
				Sharing: share.SharingIPC, LeaseTimeout: 400 * time.Millisecond,
				Logger: slog.New(slog.NewTextHandler(log, nil)),
			})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			var take func(context.Context) (*share.Buffer, error)
			if kind == "ring" {
				r, err := e.NewRing(2, 256)
				if err != nil {
					t.Fatal(err)
				}
				take = r.Acquire
			} else {
				a, err := e.NewArena(512)
				if err != nil {
					t.Fatal(err)
				}
				take = func(ctx context.Context) (*share.Buffer, error) { return a.Alloc(ctx, 256) }
			}
			c := startIn(t, e, 2, 1, 1, func(c *inConsumer) { c.holdAll = true })
			for range 2 {
				b, err := take(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if err := e.Offer(ctx, b, share.OfferOptions{}); err != nil {
					t.Fatal(err)
				}
				b.Free()
			}
			waitUntil(t, "the consumer holding both buffers", func() bool { return c.n.Load() == 2 })
			c.stop(true) // lost, holding both
			wctx, cancel := context.WithCancel(ctx)
			waited := make(chan error, 1)
			go func() {
				_, err := take(wctx)
				waited <- err
			}()
			want := "hold every buffer of a ring"
			if kind == "arena" {
				want = "hold everything in use of an arena"
			}
			waitUntil(t, "the warning", func() bool { return strings.Contains(log.String(), want) })
			select {
			case err := <-waited:
				t.Fatalf("the wait for the lost consumer's buffers ended: %v", err)
			default:
			}
			cancel()
			if err := <-waited; !errors.Is(err, context.Canceled) {
				t.Fatalf("the wait, cancelled: %v", err)
			}
			if !strings.Contains(log.String(), "holders=") {
				t.Fatalf("the warning does not name the consumers held for:\n%s", log.String())
			}
		})
	}
}
