//go:build linux

package transport

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// blockingHandler blocks its first Handle until release is closed, and
// counts the records written after closed was set.
type blockingHandler struct {
	entered, release chan struct{}
	first            atomic.Bool
	closed           atomic.Bool
	late             atomic.Int32
}

func (h *blockingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *blockingHandler) Handle(_ context.Context, r slog.Record) error {
	if h.first.CompareAndSwap(false, true) {
		close(h.entered)
		<-h.release
	}
	if h.closed.Load() {
		h.late.Add(1)
	}
	return nil
}
func (h *blockingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *blockingHandler) WithGroup(string) slog.Handler      { return h }

// TestRateLimitNoFlushAfterClose: a flush the timer began before close has
// written by the time close returns: nothing of the limit outlives its
// listener. (A first version let it write after.)
func TestRateLimitNoFlushAfterClose(t *testing.T) {
	h := &blockingHandler{entered: make(chan struct{}), release: make(chan struct{})}
	r := &rateLimit{tokens: 0, base: h}
	lg := slog.New(&limitedHandler{h: slog.NewTextHandler(io.Discard, nil), l: r})
	lg.Warn("held back") // arms the flush
	select {
	case <-h.entered: // the timer's flush is writing
	case <-time.After(10 * flushAfter):
		t.Fatal("no flush")
	}
	done := make(chan struct{})
	go func() { r.close(); close(done) }()
	select {
	case <-done:
		h.closed.Store(true) // close returned under the flush's write
	case <-time.After(100 * time.Millisecond):
	}
	close(h.release)
	<-done
	if n := h.late.Load(); n > 0 {
		t.Fatalf("%d record(s) written by the limit's flush after close returned", n)
	}
}

// TestRateLimitAfterClose: once closed (the listener takes no more peers),
// what its connections still log passes, since no flush would count it.
func TestRateLimitAfterClose(t *testing.T) {
	var out bytes.Buffer
	r := &rateLimit{tokens: 0, base: slog.NewTextHandler(&out, nil)}
	lg := slog.New(&limitedHandler{h: slog.NewTextHandler(&out, nil), l: r})
	r.close()
	lg.Warn("a connection's record after the listener closed")
	if !strings.Contains(out.String(), "after the listener closed") {
		t.Fatalf("a record after close was held back, and nothing will count it: %q", out.String())
	}
}
