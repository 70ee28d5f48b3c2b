package pool_test

import (
	"context"
	"testing"

	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/pool"
	"github.com/seed743c36cf/cudashare/share"
)

// TestStats: a pool counts nothing until Stats is first called, then
// every lease its handler takes from then on (a worker's call under way
// at the first Stats is not counted), and time spent in the handler.
func TestStats(t *testing.T) {
	env := sharetest.Setup(t)
	p, im := dial(t, env, 8, sharetest.EnvParam(sharetest.ParamCount, 50))
	gate := make(chan struct{})
	var pl *pool.Pool
	pl = pool.Start(sharetest.Ctx(t), im, 2, func(ctx context.Context, l *share.Lease) error {
		<-gate
		return nil
	})
	if s := pl.Stats(); s.Workers != 2 || s.Handled != 0 || s.Busy != 0 {
		t.Errorf("before any lease: %+v", s)
	}
	close(gate)
	if err := pl.Wait(); err != nil {
		t.Fatal(err)
	}
	if s := pl.Stats(); s.Handled < 50-2 || s.Handled > 50 || s.Busy <= 0 {
		t.Errorf("after 50 leases: %+v, want 48 to 50 handled (2 workers) and some time busy", s)
	}
	checkImporter(t, im)
	producerDone(t, p)
}
