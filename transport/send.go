//go:build linux

package transport

import (
	"context"
	"fmt"
)

// SendOffer queues an offer. It waits, within ctx, for a credit from the
// consumer and for room in the output queue. Only a producer sends offers.
func (c *Conn) SendOffer(ctx context.Context, o *Offer) error {
	if err := c.may(KindOffer); err != nil {
		return err
	}
	if err := o.checkRange(); err != nil {
		return err
	}
	if err := checkMeta(o.Meta); err != nil {
		return err
	}
	switch o.HandleKind {
	case HandleIPC:
	case HandleVMM:
		if c.peer.Caps&CapVMM == 0 {
			return fmt.Errorf("%w: %s does not accept descriptors, so not vmm handles", ErrNotSupported, c.desc)
		}
	case HandleFabric:
		if c.peer.Caps&CapFabric == 0 {
			return fmt.Errorf("%w: %s does not import fabric handles", ErrNotSupported, c.desc)
		}
	default:
		return fmt.Errorf("transport: offer with unknown %s", o.HandleKind)
	}
	var dups []int
	if len(o.FDs) > 0 {
		if len(o.FDs) > MaxFDs {
			return fmt.Errorf("transport: offer with %d descriptors, limit %d", len(o.FDs), MaxFDs)
		}
		if c.peer.Caps&CapVMM == 0 {
			return fmt.Errorf("%w: %s does not accept descriptors", ErrNotSupported, c.desc)
		}
		var err error
		if dups, err = dupFDs(o.FDs); err != nil {
			return err
		}
	}
	if err := c.lockRoom(ctx, true); err != nil {
		closeFDs(dups)
		return err
	}
	off := len(c.out)
	c.out = appendOffer(c.out, o)
	if dups != nil {
		c.outFDs = append(c.outFDs, pendingFDs{off: off, fds: dups})
	}
	c.outstanding++
	c.unlockAndKick(off)
	return nil
}

// SendRelease queues the release of the offers with the given sequence
// numbers, in as many messages as MaxReleaseSeqs requires. Only a consumer
// sends releases, and only for offers it holds.
func (c *Conn) SendRelease(ctx context.Context, seqs ...uint64) error {
	return c.sendRelease(ctx, nil, seqs)
}

// SendReleaseAfter queues a stream-ordered release: the offers are
// released once the work recorded by the interprocess event ev (a
// CUipcEventHandle) is done; the producer's next write of them waits for
// the event on the GPU. Only to a producer that advertised
// CapReleaseEvents (else ErrNotSupported); the event must have been
// recorded before the call.
func (c *Conn) SendReleaseAfter(ctx context.Context, ev Handle, seqs ...uint64) error {
	if c.peer.Caps&CapReleaseEvents == 0 {
		return fmt.Errorf("%w: %s does not take release events", ErrNotSupported, c.desc)
	}
	return c.sendRelease(ctx, &ev, seqs)
}

// queueReleaseLater queues the release of seqs, after the event ev if not nil
// (as SendReleaseAfter), without writing it: it leaves with the next
// message sent, or at push. A consumer that releases leases one by one
// while more offers are arriving sends many in one write this way; it must
// push before it waits for anything from the producer, and soon in any
// case (the producer's lease deadline counts until the release arrives).
func (c *Conn) queueReleaseLater(ctx context.Context, ev *Handle, seqs ...uint64) error {
	if ev != nil && c.peer.Caps&CapReleaseEvents == 0 {
		return fmt.Errorf("%w: %s does not take release events", ErrNotSupported, c.desc)
	}
	return c.queueRelease(ctx, ev, seqs, true)
}

// push writes what queueReleaseLater left queued, as a send would.
func (c *Conn) push() {
	c.mu.Lock()
	if len(c.out) == 0 || c.err != nil {
		c.mu.Unlock()
		return
	}
	c.unlockAndKick(len(c.out))
}

func (c *Conn) sendRelease(ctx context.Context, ev *Handle, seqs []uint64) error {
	return c.queueRelease(ctx, ev, seqs, false)
}

func (c *Conn) queueRelease(ctx context.Context, ev *Handle, seqs []uint64, lazy bool) error {
	if err := c.may(KindRelease); err != nil {
		return err
	}
	for len(seqs) > 0 {
		n := min(len(seqs), MaxReleaseSeqs)
		if err := c.lockRoom(ctx, false); err != nil {
			return err
		}
		if uint64(n) > c.outstanding {
			c.mu.Unlock()
			return fmt.Errorf("%w: releasing %d offers, %d outstanding", ErrCredit, n, c.outstanding)
		}
		c.outstanding -= uint64(n)
		off := len(c.out)
		c.out = appendRelease(c.out, seqs[:n], ev)
		if lazy && len(c.out) < c.cfg.MaxQueued/2 {
			c.queued += uint64(len(c.out) - off)
			c.mu.Unlock()
		} else {
			c.unlockAndKick(off)
		}
		seqs = seqs[n:]
	}
	return nil
}

// SendRetire queues the retirement of an allocation: the producer wants to
// free it, and the consumer is to close its mapping and answer with
// closed. Only a producer sends it.
func (c *Conn) SendRetire(ctx context.Context, allocID uint64) error {
	return c.sendUint(ctx, KindRetire, allocID)
}

// SendClosed queues the consumer's confirmation that it closed its mapping
// of an allocation. Only a consumer sends it.
func (c *Conn) SendClosed(ctx context.Context, allocID uint64) error {
	return c.sendUint(ctx, KindClosed, allocID)
}

// SendCredit grants the producer n more outstanding offers. Only a
// consumer sends it.
func (c *Conn) SendCredit(ctx context.Context, n uint32) error {
	if n == 0 {
		return nil
	}
	return c.sendUint(ctx, KindCredit, uint64(n))
}

func (c *Conn) sendUint(ctx context.Context, k Kind, v uint64) error {
	if err := c.may(k); err != nil {
		return err
	}
	if err := c.lockRoom(ctx, false); err != nil {
		return err
	}
	if k == KindCredit {
		if c.window+v > MaxWindow {
			c.mu.Unlock()
			return fmt.Errorf("%w: window of %d credits, limit %d", ErrCredit, c.window+v, MaxWindow)
		}
		c.window += v
	}
	off := len(c.out)
	c.out = appendUintMsg(c.out, k, v)
	c.unlockAndKick(off)
	return nil
}

// may reports whether this side's role sends messages of kind k.
func (c *Conn) may(k Kind) error {
	mine := c.cfg.Role
	if (k == KindOffer || k == KindRetire) != (mine == RoleProducer) {
		return fmt.Errorf("%w: a %s does not send %s", ErrUnexpectedMessage, mine, k)
	}
	return nil
}

// Flush waits, within ctx, until every message queued before the call has
// been written to the socket.
func (c *Conn) Flush(ctx context.Context) error {
	c.push()
	c.mu.Lock()
	target := c.queued
	for {
		if c.err != nil {
			err := c.err
			c.mu.Unlock()
			return err
		}
		if c.written >= target {
			break
		}
		if err := c.waitProgressLocked(ctx); err != nil {
			return err
		}
	}
	c.mu.Unlock()
	return nil
}
