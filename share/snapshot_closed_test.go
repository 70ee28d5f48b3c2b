//go:build linux

package share_test

import (
	"testing"

	"github.com/seed743c36cf/cudashare/internal/sharetest"
)

// TestSnapshotOfClosedExporter: a snapshot (a Prometheus scrape, an
// observer) of an exporter that closed, or closes meanwhile, is a
// picture of it, not a panic.
func TestSnapshotOfClosedExporter(t *testing.T) {
	env := sharetest.Setup(t)
	e := newExporter(t, env)
	if _, err := e.NewRing(2, 4096); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range 200 {
			e.Snapshot()
		}
	}()
	e.Close()
	<-done
	if s := e.Snapshot(); s.Stats.Consumers != 0 {
		t.Errorf("closed exporter's snapshot counts %d consumers", s.Stats.Consumers)
	}
}
