//go:build linux

package share

import (
	"context"
	"fmt"

	"github.com/seed743c36cf/cudashare/transport"
	"github.com/vmihailenco/msgpack/v5"
)

// This file serves an exporter's snapshots to observers on its own
// socket (`cudashare top`; PROTOCOL.md, section 9), and is the observer's
// side.

// encodeSnapshot is what the exporter's listener serves an observer: a
// snapshot in msgpack, trimmed to transport.MaxSnapshotSize by leaving
// out the consumers holding the fewest leases. It runs on the observer's
// goroutine, never on one that offers.
func (e *Exporter) encodeSnapshot() []byte {
	s := e.Snapshot()
	for {
		b, err := msgpack.Marshal(&s)
		if err != nil {
			e.log.Warn("share: encoding a snapshot failed", "err", err)
			return []byte{0x80} // an empty map: the observer sees nothing rather than a broken frame
		}
		if len(b) <= transport.MaxSnapshotSize || len(s.Consumers) == 0 {
			return b
		}
		// Proportionally fewer, and at least one fewer.
		keep := min(len(s.Consumers)-1, len(s.Consumers)*transport.MaxSnapshotSize/len(b))
		s.Truncated += len(s.Consumers) - keep
		s.Consumers = s.Consumers[:keep]
	}
}

// Observer reads a running producer's snapshots.
type Observer struct {
	o *transport.Observer
}

// Observe connects to the producer at path as an observer: it takes no
// credit and gets no offers. Only the producer's user may observe.
func Observe(ctx context.Context, path string) (*Observer, error) {
	o, err := transport.DialObserver(ctx, path, transport.DefaultConfig(transport.RoleObserver))
	if err != nil {
		return nil, err
	}
	return &Observer{o: o}, nil
}

// Snapshot asks the producer for a snapshot. The producer serves one
// per transport.ObserverInterval at most: a faster caller waits.
func (o *Observer) Snapshot(ctx context.Context) (ExporterSnapshot, error) {
	var s ExporterSnapshot
	b, err := o.o.Snapshot(ctx)
	if err != nil {
		return s, err
	}
	if err := msgpack.Unmarshal(b, &s); err != nil {
		return s, fmt.Errorf("share: decode a snapshot: %w", err)
	}
	return s, nil
}

// Close closes the connection; idempotent.
func (o *Observer) Close() error { return o.o.Close() }
