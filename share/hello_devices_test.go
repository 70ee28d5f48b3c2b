//go:build linux

package share_test

import (
	"slices"
	"testing"

	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/share"
	"github.com/seed743c36cf/cudashare/transport"
)

// TestHelloAckDevices: the producer's hello-ack lists the device it offers
// from, and only it (PROTOCOL.md section 4, hello): what a consumer may
// use to choose how to import.
func TestHelloAckDevices(t *testing.T) {
	env := sharetest.Setup(t)
	e := newExporterWith(t, env, share.ExporterConfig{})
	defer e.Close() // before the leak check dialIn arms
	conn := dialIn(t, e, 1, false)
	defer conn.Close()
	if got, want := conn.Peer().Devices, []transport.UUID{env.Ctx.Device().UUID()}; !slices.Equal(got, want) {
		t.Fatalf("hello-ack devices %v, want %v (the device offered from)", got, want)
	}
}
