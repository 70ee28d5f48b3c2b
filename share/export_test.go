//go:build linux

package share

import (
	"context"
	"errors"

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

// LendToClosedConsumer closes, on this side, the connection of the
// consumer that Offer would pick next and lends b to it as Offer does: the
// race of a consumer's connection closing under a send, made certain (the
// lock held from the pick to the send keeps the consumer's receive loop
// from dropping it first). With why, the connection fails with it instead,
// as when the exporter drops the consumer (kick) while an offer to it is
// being sent: the send then returns why.
func LendToClosedConsumer(ctx context.Context, e *Exporter, b *Buffer, opts OfferOptions, why error) (lent bool, err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	c := e.pickLocked()
	if c == nil {
		return false, errors.New("no consumer to lend to")
	}
	if why != nil {
		c.conn.CloseWithError(why)
	} else {
		c.conn.Close()
	}
	return e.lendLocked(ctx, c, b, &opts, true)
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

// LendToConsumerLostDuringSend lends b, as Offer does, to the consumer
// Offer would pick next, and loses that consumer while the offer is being
// sent: its connection is closed and the exporter has handled the loss
// (onGone) before the send starts (delivered false: the send then fails)
// or after it returned (delivered true: the offer went out). It restores
// the hooks before returning.
func LendToConsumerLostDuringSend(ctx context.Context, e *Exporter, b *Buffer, opts OfferOptions, delivered bool) (lent bool, err error) {
	lent, _, err = lendLosing(ctx, e, b, opts, delivered, nil)
	return lent, err
}
