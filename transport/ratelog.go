package transport

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// A listener logs a warning for each connection it refuses, evicts or fails
// to handshake. Those come from peers, as fast as peers connect: a client
// in a reconnect loop, or hundreds of silent connections, wrote 600,000
// lines (158 MB) in 107 s. The listener's log is therefore limited: a burst
// of logBurst records passes, then logPerSecond a second, and the next
// record that passes says how many were held back since the one before it.
const (
	logBurst     = 20
	logPerSecond = 1
)

// limitedHandler is a slog.Handler that lets through what its rateLimit
// allows. Copies made by WithAttrs and WithGroup share the limit.
type limitedHandler struct {
	h slog.Handler
	l *rateLimit
}

// rateLimit is a token bucket on the records' own times.
type rateLimit struct {
	mu         sync.Mutex
	tokens     float64
	last       time.Time
	suppressed int
}

// limitLogger returns a logger that writes to l's handler what the limit
// allows.
func limitLogger(l *slog.Logger) *slog.Logger {
	return slog.New(&limitedHandler{h: l.Handler(), l: &rateLimit{tokens: logBurst}})
}

// take spends a token at time now, if one is left: ok, and how many
// records were held back before this one.
func (r *rateLimit) take(now time.Time) (ok bool, held int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.last.IsZero() && now.After(r.last) {
		r.tokens = min(logBurst, r.tokens+now.Sub(r.last).Seconds()*logPerSecond)
	}
	if now.After(r.last) {
		r.last = now
	}
	if r.tokens < 1 {
		r.suppressed++
		return false, 0
	}
	r.tokens--
	held, r.suppressed = r.suppressed, 0
	return true, held
}

func (h *limitedHandler) Enabled(ctx context.Context, level slog.Level) bool {
	return h.h.Enabled(ctx, level)
}

func (h *limitedHandler) Handle(ctx context.Context, rec slog.Record) error {
	now := rec.Time
	if now.IsZero() {
		now = time.Now()
	}
	ok, held := h.l.take(now)
	if !ok {
		return nil
	}
	if held > 0 {
		rec = rec.Clone()
		rec.AddAttrs(slog.Int("suppressed", held))
	}
	return h.h.Handle(ctx, rec)
}

func (h *limitedHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return &limitedHandler{h: h.h.WithAttrs(attrs), l: h.l}
}

func (h *limitedHandler) WithGroup(name string) slog.Handler {
	return &limitedHandler{h: h.h.WithGroup(name), l: h.l}
}
