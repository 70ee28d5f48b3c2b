package main

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/share"
)

// TestTopRatesFollowAConsumer: the rates between two refreshes are the
// counters' differences over the time between them, for a consumer that
// is still the same connection, however long it has been connected
// (its Connected age grows between snapshots; its connect time does not).
func TestTopRatesFollowAConsumer(t *testing.T) {
	prev := share.ExporterSnapshot{Uptime: 100 * time.Second, Consumers: []share.ConsumerSnapshot{
		{PID: 42, Comm: "c", State: "active", Path: "shm", Connected: 90 * time.Second, Offers: 1_000_000, Releases: 1_000_000},
	}}
	now := share.ExporterSnapshot{Uptime: 101 * time.Second, Consumers: []share.ConsumerSnapshot{
		{PID: 42, Comm: "c", State: "active", Path: "shm", Connected: 91 * time.Second, Offers: 1_000_500, Releases: 1_000_400},
	}}
	var out bytes.Buffer
	writeTop(&out, &now, &prev)
	var row []string
	for line := range strings.Lines(out.String()) {
		if f := strings.Fields(line); len(f) > 0 && f[0] == "42" {
			row = f
		}
	}
	if row == nil {
		t.Fatalf("no row for pid 42:\n%s", out.String())
	}
	// PID COMM STATE PATH CREDITS LEASES OLDEST LEASED MAPPED OFFERS/s RELEASES/s ...
	if row[9] != "500" || row[10] != "400" {
		t.Errorf("OFFERS/s %s RELEASES/s %s, want 500 and 400 (one second apart)\n%s", row[9], row[10], out.String())
	}
}
