//go:build linux

package share

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/transport"
)

// RegistryProbe exposes a registry's acquire and release of one key to the
// external tests and benchmarks.
type RegistryProbe struct {
	r *Registry
	k regKey
	e *regEntry
}

func NewRegistryProbe(r *Registry, pid int32, src, dst driver.UUID, h driver.IpcMemHandle) *RegistryProbe {
	return &RegistryProbe{r: r, k: regKey{pid: pid, src: src, dst: dst, handle: transport.Handle(h)}}
}

// Acquire takes one hold on the mapping, opening it on first use.
func (p *RegistryProbe) Acquire(dctx *driver.Context, allocID, allocSize uint64) (driver.DevicePtr, error) {
	e, err := p.r.acquire(dctx, &p.k, allocID, allocSize)
	if err != nil {
		return 0, err
	}
	p.e = e
	return e.ptr, nil
}

// Release drops one hold.
func (p *RegistryProbe) Release() error { return p.r.release(p.e) }

// OfferToClosedConsumer closes, on this side, the connection of the
// consumer that Offer would pick next and offers b to it as Offer does: the
// race of a consumer's connection closing under a send, made certain (the
// lock held from the pick to the send keeps the consumer's receive loop
// from dropping it first). With why, the connection fails with it instead,
// as when the exporter drops the consumer (kick) while an offer to it is
// being sent: the send then returns why.
func OfferToClosedConsumer(ctx context.Context, e *Exporter, b *Buffer, opts OfferOptions, why error) (offered bool, err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	c := e.pickLocked()
	if c == nil {
		return false, errors.New("no consumer to offer to")
	}
	if why != nil {
		c.conn.CloseWithError(why)
	} else {
		c.conn.Close()
	}
	return e.offerToLocked(ctx, c, b, &opts, true)
}

// TransportDropThenKick replays the lease janitor's (and Shutdown's)
// interleaving with a transport drop: a consumer picked under mu, neither
// ended nor kicked; mu unlocked; meanwhile the transport fails its
// connection for cause (transportWhy, as its writer does on a write
// timeout) and the receive loop ends it (onGone); then the kick (kickWhy).
func TransportDropThenKick(e *Exporter, transportWhy, kickWhy error) bool {
	e.mu.Lock()
	var c *consumer
	for cc := range e.conns {
		if !cc.ended && !cc.kicked {
			c = cc
			break
		}
	}
	e.mu.Unlock()
	if c == nil {
		return false
	}
	c.conn.CloseWithError(transportWhy)
	waitEnded(e, c)
	e.kick(c, kickWhy)
	return true
}

// OfferToConsumerLostDuringSend offers b, as Offer does, to the consumer
// Offer would pick next, and loses that consumer while the offer is being
// sent: its connection is closed and the exporter has handled the loss
// (onGone) before the send starts (delivered false: the send then fails)
// or after it returned (delivered true: the offer went out). It restores
// the hooks before returning.
func OfferToConsumerLostDuringSend(ctx context.Context, e *Exporter, b *Buffer, opts OfferOptions, delivered bool) (offered bool, err error) {
	offered, _, err = offerLosing(ctx, e, b, opts, delivered, nil)
	return offered, err
}

// ExpireLeases runs the lease deadline as if the lease timeout had passed
// for every lease held now: each consumer holding a lease is dropped, as
// the lease janitor drops it. It returns how many were. A test can then
// make the deadline pass at a point of its choosing, with LeaseTimeout
// off, instead of waiting for it.
func ExpireLeases(e *Exporter, timeout time.Duration) int {
	e.mu.Lock()
	e.clock.epoch += leaseTicks + 1
	stuck, why := e.overdueLocked(timeout)
	e.mu.Unlock()
	for i, c := range stuck {
		e.kick(c, why[i])
	}
	return len(stuck)
}

// LeasesOf returns the leases held by the consumers of process pid that
// take offers, so that a test can tell one consumer's from the others'.
func LeasesOf(e *Exporter, pid int) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	n := 0
	for _, c := range e.policy.consumers {
		if int(c.peer.PID) == pid {
			n += int(c.out)
		}
	}
	return n
}

// CheckLeaseCounts reports whether the exporter's counts of the leases
// held by newcomers and by consumers that have released agree with its
// consumers' own counts.
func CheckLeaseCounts(e *Exporter) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	var nc, rel int
	for _, c := range e.policy.consumers {
		if c.released {
			rel += int(c.out)
		} else {
			nc += int(c.out)
		}
	}
	if nc != e.policy.newcomerOut || rel != e.policy.releasedOut {
		return fmt.Errorf("the exporter counts %d leases held by newcomers and %d by consumers that have released; its consumers hold %d and %d",
			e.policy.newcomerOut, e.policy.releasedOut, nc, rel)
	}
	return nil
}
