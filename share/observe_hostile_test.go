//go:build linux

package share_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"net"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/share"
)

// rawObserverHello is a hello with role observer (3) that lies: it claims
// a pid not its own, credits, devices and the shm capability.
func rawObserverHello() []byte {
	body, _ := msgpack.Marshal([]any{1, 1, 3, 4242, bytes.Repeat([]byte{7}, 16), [][]byte{bytes.Repeat([]byte{1}, 16)}, 0xff, 1000})
	frame := binary.BigEndian.AppendUint32(nil, uint32(len(body)))
	return append(frame, body...)
}

// TestHostileObserver: observers that flood requests and never read,
// lie in their hello, send what an observer may not, or connect a hundred
// times change nothing for a consumer: it keeps receiving offers, and
// once they are gone the producer holds none of their descriptors or
// goroutines (TestMain fails the run on a leak).
func TestHostileObserver(t *testing.T) {
	env := sharetest.Setup(t)
	e := newExporter(t, env)
	ctx := sharetest.Ctx(t)
	c := startConsumer(t, e, sharetest.EnvParam(sharetest.ParamMax, 0))
	if err := e.WaitConsumers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	r, err := e.NewRing(4, 4096)
	if err != nil {
		t.Fatal(err)
	}
	dial := func() net.Conn {
		nc, err := net.Dial("unix", e.Addr())
		if err != nil {
			t.Fatal(err)
		}
		return nc
	}
	var hostile []net.Conn
	// Floods snapshot requests and never reads a snapshot.
	flood := dial()
	hostile = append(hostile, flood)
	flood.Write(rawObserverHello())
	go func() {
		req := []byte{0, 0, 0, 2, 0x91, 16}
		for {
			if _, err := flood.Write(bytes.Repeat(req, 1024)); err != nil {
				return
			}
		}
	}()
	// Sends a release, as if it were a consumer.
	liar := dial()
	hostile = append(hostile, liar)
	liar.Write(rawObserverHello())
	liar.Write([]byte{0, 0, 0, 3, 0x92, 4, 0x90})
	// Connects a hundred times, half of them silent.
	for i := range 100 {
		nc := dial()
		hostile = append(hostile, nc)
		if i%2 == 0 {
			nc.Write(rawObserverHello())
			nc.Write([]byte{0, 0, 0, 2, 0x91, 16})
		}
	}
	// Meanwhile the consumer is served.
	offerRing(t, env, e, r, 0, 200)
	if s := e.Snapshot(); s.Stats.Consumers != 1 || len(s.Consumers) != 1 || s.Consumers[0].Offers != 200 {
		t.Errorf("with hostile observers: %d consumers, %+v; want the one consumer with its 200 offers", s.Stats.Consumers, s.Consumers)
	}
	for _, nc := range hostile {
		nc.Close()
	}
	// A polite observer still gets in once they are gone.
	var o *share.Observer
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if o, err = share.Observe(ctx, e.Addr()); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no observer gets in after the hostile ones left: %v", err)
		}
	}
	defer o.Close()
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := o.Snapshot(sctx); err != nil {
		t.Fatal(err)
	}
	o.Close()
	shutdown(t, e)
	c.Wait()
}
