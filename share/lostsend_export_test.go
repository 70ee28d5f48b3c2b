//go:build linux

package share

import (
	"context"
	"errors"
	"sync"
	"time"
)

// Helpers of lostsend_test.go: consumers lost while an offer to them is
// being sent, made certain with the send hooks.

// LostInfo is a lost consumer's state as the exporter keeps it.
type LostInfo struct {
	Dropped       bool // forgotten (dropLocked)
	Abandoned     int  // c.abandoned
	ProcAbandoned int  // c.proc.abandoned
	Watched       bool // its process's watch is still live in e.pids
	InConns       bool
	Voided        int
}

func lostInfoLocked(e *Exporter, c *consumer) LostInfo {
	li := LostInfo{Dropped: c.dropped, Abandoned: c.abandoned, Voided: len(c.voided)}
	_, li.InConns = e.conns[c]
	if c.proc != nil {
		li.ProcAbandoned = c.proc.abandoned
		li.Watched = e.pids[c.proc.pid] == c.proc
	}
	return li
}

// loseConsumer closes c's connection on this side and waits until the
// exporter has handled the loss.
func loseConsumer(e *Exporter, c *consumer) {
	c.conn.Close()
	waitEnded(e, c)
}

// waitEnded waits until the exporter has ended c (onGone, which runs after
// c.done closes).
func waitEnded(e *Exporter, c *consumer) {
	<-c.done
	for {
		e.mu.Lock()
		ended := c.ended
		e.mu.Unlock()
		if ended {
			return
		}
		time.Sleep(time.Millisecond)
	}
}

// offerLosing offers b, as Offer does, to the consumer Offer would pick
// next, and loses it during the send: before the send starts (delivered
// false) or after it returned (delivered true), then runs then (if not
// nil), with mu unlocked. It returns the lost consumer; it restores the
// hooks before returning.
func offerLosing(ctx context.Context, e *Exporter, b *Buffer, opts OfferOptions, delivered bool, then func()) (bool, *consumer, error) {
	var lost *consumer
	lose := func(c *consumer) {
		lost = c
		loseConsumer(e, c)
		if then != nil {
			then()
		}
	}
	if delivered {
		testHookAfterSend = lose
	} else {
		testHookBeforeSend = lose
	}
	defer func() { testHookBeforeSend, testHookAfterSend = nil, nil }()
	e.mu.Lock()
	defer e.mu.Unlock()
	c := e.pickLocked()
	if c == nil {
		return false, nil, errors.New("no consumer to offer to")
	}
	offered, err := e.offerToLocked(ctx, c, b, &opts, true)
	return offered, lost, err
}

// OfferLostDuringSendInfo is OfferToConsumerLostDuringSend, returning the
// lost consumer's state afterwards.
func OfferLostDuringSendInfo(ctx context.Context, e *Exporter, b *Buffer, opts OfferOptions, delivered bool) (bool, LostInfo, error) {
	offered, lost, err := offerLosing(ctx, e, b, opts, delivered, nil)
	if lost == nil {
		return offered, LostInfo{}, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return offered, lostInfoLocked(e, lost), err
}

// OfferThenLose offers b to the consumer Offer picks (the send completes),
// then loses that consumer: the pre-existing path (releaseVMMLocked
// abandons a sent slot). It returns the lost consumer's state.
func OfferThenLose(ctx context.Context, e *Exporter, b *Buffer, opts OfferOptions) (bool, LostInfo, error) {
	e.mu.Lock()
	c := e.pickLocked()
	if c == nil {
		e.mu.Unlock()
		return false, LostInfo{}, errors.New("no consumer")
	}
	offered, err := e.offerToLocked(ctx, c, b, &opts, true)
	e.mu.Unlock()
	loseConsumer(e, c)
	e.mu.Lock()
	defer e.mu.Unlock()
	return offered, lostInfoLocked(e, c), err
}

// BroadcastLosingFirst broadcasts b; the first target is lost: during its
// send (sentFirst false: after the send returned, before finishLocked), or
// once its offer was sent, when the second target's send starts (sentFirst
// true: the pre-existing path). Every later send pauses for pause after it
// returns, as a loaded machine may.
func BroadcastLosingFirst(ctx context.Context, e *Exporter, b *Buffer, opts OfferOptions, sentFirst bool, pause time.Duration) (int, error) {
	var mu sync.Mutex
	n := 0
	var first *consumer
	testHookBeforeSend = func(c *consumer) {
		mu.Lock()
		n++
		k := n
		if k == 1 {
			first = c
		}
		mu.Unlock()
		if sentFirst && k == 2 {
			loseConsumer(e, first)
		}
	}
	testHookAfterSend = func(c *consumer) {
		mu.Lock()
		k := n
		mu.Unlock()
		if k == 1 && !sentFirst {
			loseConsumer(e, c)
			return
		}
		if k >= 2 {
			time.Sleep(pause)
		}
	}
	defer func() { testHookBeforeSend, testHookAfterSend = nil, nil }()
	return e.Broadcast(ctx, b, opts)
}

// OfferLostDuringSendThen is OfferToConsumerLostDuringSend that runs then()
// in the hook right after the loss (mu unlocked, send in flight or done).
func OfferLostDuringSendThen(ctx context.Context, e *Exporter, b *Buffer, opts OfferOptions, delivered bool, then func()) (bool, error) {
	offered, _, err := offerLosing(ctx, e, b, opts, delivered, then)
	return offered, err
}

// Closing reports e.closing.
func Closing(e *Exporter) bool { e.mu.Lock(); defer e.mu.Unlock(); return e.closing }
