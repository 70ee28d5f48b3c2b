//go:build linux

package transport

import (
	"context"
	"log/slog"
	"time"

	"github.com/seed743c36cf/cudashare/internal/transportx"
)

// What only package share needs reaches it through transportx (see
// there), so that transport exports only what a program speaking the
// protocol needs.
func init() {
	transportx.NewPoller = func(spin time.Duration) (any, error) { return newPoller(spin) }
	transportx.TryRecv = (*Conn).tryRecv
	transportx.Interrupt = (*Conn).interrupt
	transportx.QueueRelease = func(c *Conn, ctx context.Context, ev *Handle, seqs ...uint64) error {
		return c.queueReleaseLater(ctx, ev, seqs...)
	}
	transportx.Push = (*Conn).push
	transportx.PeerHungUp = (*Conn).peerHungUp
	transportx.PeerSocket = (*Conn).peerSocket
	transportx.PeerLogger = func(l *Listener) *slog.Logger { return l.peerLogger() }
	transportx.ErrInterrupted = errInterrupted
}
