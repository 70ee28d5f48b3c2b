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

// rateLimit is a token bucket on the records' own times. Records held
// back are counted on the next that passes or, if none comes (the flood
// ended), by a record of their own a little later (flush), so that no
// count is lost.
type rateLimit struct {
	mu         sync.Mutex
	tokens     float64
	last       time.Time
	suppressed int
	base       slog.Handler // where flush writes
	timer      *time.Timer  // the flush armed, if any
	closed     bool         // no flush is armed any more
	// flushMu serializes flushes, their writes included, so that close
	// returns after a flush the timer started.
	flushMu sync.Mutex
}

// limitLogger returns a logger that writes to l's handler what the limit
// allows, and the limit, to close with its user.
func limitLogger(l *slog.Logger) (*slog.Logger, *rateLimit) {
	r := &rateLimit{tokens: logBurst, base: l.Handler()}
	return slog.New(&limitedHandler{h: l.Handler(), l: r}), r
}

// close says at once how many records were held back, and arms no flush
// any more: nothing of it outlives its listener.
func (r *rateLimit) close() {
	r.mu.Lock()
	r.closed = true
	if r.timer != nil {
		r.timer.Stop()
	}
	r.mu.Unlock()
	r.flushNow(true)
}

// flushAfter is how long after the first record held back flush looks
// whether a later record has counted it.
const flushAfter = 2 * time.Second / logPerSecond

// flush writes how many records were held back since the last that
// passed, if no record has passed since to say so.
func (r *rateLimit) flush() { r.flushNow(false) }

// flushNow is flush; final is close's, the timer's (not final) writes
// nothing once the limit is closed: close has counted, or will.
func (r *rateLimit) flushNow(final bool) {
	r.flushMu.Lock()
	defer r.flushMu.Unlock()
	r.mu.Lock()
	if r.closed && !final {
		r.mu.Unlock()
		return
	}
	n := r.suppressed
	r.suppressed, r.timer = 0, nil
	r.mu.Unlock()
	if n == 0 {
		return
	}
	rec := slog.NewRecord(time.Now(), slog.LevelWarn, "transport: log records held back (a flood of peers)", 0)
	rec.AddAttrs(slog.Int("suppressed", n))
	_ = r.base.Handle(context.Background(), rec)
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
	if r.tokens < 1 && !r.closed {
		// Once closed (the listener is, and takes no more peers), what its
		// connections still log passes: no flush would count it.
		r.suppressed++
		if r.timer == nil && !r.closed {
			r.timer = time.AfterFunc(flushAfter, r.flush)
		}
		return false, 0
	}
	r.tokens = max(0, r.tokens-1)
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
