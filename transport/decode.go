package transport

import (
	"fmt"
	"math"
)

// decoder turns one frame body into a Message. Its scratch space makes the
// views in a decoded Message valid until the next decode.
type decoder struct {
	seqs  [MaxReleaseSeqs]uint64
	hello hello
	// nfds is the descriptor count the last offer declared.
	nfds int
	// errCode and errText hold the last error message.
	errCode uint32
	errText string
}

// decode decodes body, one msgpack value, into m (kinds offer to goodbye),
// d.hello (hello, hello-ack) or d.errCode and d.errText (error). It checks
// every field against the schema; the order of messages is the caller's
// business.
func (d *decoder) decode(body []byte, m *Message) (Kind, error) {
	r := reader{b: body}
	n, err := r.arrayLen("message")
	if err != nil {
		return 0, err
	}
	if n < 1 {
		return 0, malformed("empty message array")
	}
	k, err := r.uint("kind")
	if err != nil {
		return 0, err
	}
	kind := Kind(k)
	if k != uint64(kind) {
		return 0, fmt.Errorf("%w: %d", ErrUnknownMessage, k)
	}
	var want int
	switch kind {
	case KindHello, KindHelloAck:
		want = min(max(n, helloFields), helloSessionFields)
		err = d.decodeHello(&r, n, kind)
	case KindOffer:
		want = min(max(n, offerFields), offerKindFields)
		err = d.decodeOffer(&r, n, &m.Offer)
	case KindRelease:
		want = min(max(n, releaseFields), releaseEventFields)
		err = d.decodeRelease(&r, n, m)
	case KindRetire, KindClosed:
		want = allocFields
		if err = needFields(kind, n, want); err == nil {
			m.AllocID, err = r.uint("alloc_id")
		}
	case KindCredit:
		want = creditFields
		if err = needFields(kind, n, want); err == nil {
			var v uint64
			v, err = r.uint("credit.n")
			switch {
			case err != nil:
			case v == 0:
				err = malformed("credit.n: 0, want at least 1")
			case v > MaxWindow:
				// A window past the limit whatever it was before: the
				// error of every window past it (PROTOCOL.md 2.2).
				err = fmt.Errorf("%w: a credit of %d, past the window's limit of %d", ErrCredit, v, MaxWindow)
			}
			m.Credits = uint32(v)
		}
	case KindGoodbye:
		want = min(max(n, goodbyeFields), goodbyeCodeFields)
		m.ByeCode = GoodbyeDone
		if err = needFields(kind, n, goodbyeFields); err == nil {
			m.Reason, err = r.str("goodbye.reason")
		}
		if err == nil && n >= goodbyeCodeFields {
			var v uint64
			if v, err = r.uint("goodbye.code"); err == nil {
				// An unknown code is the plain goodbye (PROTOCOL.md,
				// section 4, goodbye).
				if m.ByeCode = GoodbyeCode(v); uint64(m.ByeCode) != v || m.ByeCode > GoodbyeRestarting {
					m.ByeCode = GoodbyeDone
				}
			}
		}
	case KindError:
		want = errorFields
		if err = needFields(kind, n, want); err == nil {
			var v uint64
			if v, err = r.uint("error.code"); err == nil {
				d.errCode = uint32(min(v, math.MaxUint32))
				d.errText, err = r.str("error.message")
			}
		}
	default:
		return 0, fmt.Errorf("%w: %d", ErrUnknownMessage, k)
	}
	if err != nil {
		return 0, err
	}
	// Fields appended by a later revision are skipped, but still checked.
	if err := r.skipN(uint64(n-want), 0); err != nil {
		return 0, err
	}
	if r.left() != 0 {
		return 0, malformed("%d bytes after the message", r.left())
	}
	m.Kind = kind
	return kind, nil
}

func needFields(k Kind, n, want int) error {
	if n < want {
		return malformed("%s has %d fields, want %d", k, n, want)
	}
	return nil
}

func (d *decoder) decodeHello(r *reader, n int, kind Kind) (err error) {
	h := &d.hello
	h.kind = kind
	// The version comes first so that a peer of another version gets a
	// version error rather than a complaint about a layout it may not share.
	if n < 2 {
		return malformed("%s has %d fields, want %d", kind, n, helloFields)
	}
	if h.version, err = r.uint("hello.version"); err != nil {
		return err
	}
	if h.version != Version {
		return fmt.Errorf("%w: peer speaks version %d, this side %d", ErrVersion, h.version, Version)
	}
	if err := needFields(kind, n, helloFields); err != nil {
		return err
	}
	role, err := r.uint("hello.role")
	if err != nil {
		return err
	}
	if h.role = Role(role); role != uint64(h.role) || !h.role.valid() {
		return malformed("hello.role: %d", role)
	}
	if h.pid, err = r.uint("hello.pid"); err != nil {
		return err
	}
	if err := r.binN("hello.instance_id", h.instanceID[:]); err != nil {
		return err
	}
	nd, err := r.arrayLen("hello.devices")
	if err != nil {
		return err
	}
	if nd > MaxDevices {
		return malformed("hello.devices: %d devices, limit %d", nd, MaxDevices)
	}
	h.devices = make([]UUID, nd)
	for i := range h.devices {
		if err := r.binN("hello.devices", h.devices[i][:]); err != nil {
			return err
		}
	}
	caps, err := r.uint("hello.capabilities")
	if err != nil {
		return err
	}
	h.caps = Caps(caps)
	if h.credits, err = r.uint("hello.credits"); err != nil {
		return err
	}
	if h.credits > MaxWindow && h.role == RoleConsumer {
		// A window past the limit, as a credit can make one: the same
		// error (PROTOCOL.md 2.2). A producer's credits mean nothing
		// (section 3): whatever they hold is ignored.
		return fmt.Errorf("%w: hello.credits: a window of %d, limit %d", ErrCredit, h.credits, MaxWindow)
	}
	h.session = 0
	if n >= helloSessionFields {
		if h.session, err = r.uint("hello.session"); err != nil {
			return err
		}
		if h.role != RoleProducer {
			h.session = 0 // only a producer's means something
		}
	}
	return nil
}

func (d *decoder) decodeOffer(r *reader, n int, o *Offer) (err error) {
	if err := needFields(KindOffer, n, offerFields); err != nil {
		return err
	}
	if o.Seq, err = r.uint("offer.seq"); err != nil {
		return err
	}
	if o.AllocID, err = r.uint("offer.alloc_id"); err != nil {
		return err
	}
	if o.Generation, err = r.uint("offer.generation"); err != nil {
		return err
	}
	if err := r.binN("offer.handle", o.Handle[:]); err != nil {
		return err
	}
	if o.AllocSize, err = r.uint("offer.alloc_size"); err != nil {
		return err
	}
	if o.Offset, err = r.uint("offer.offset"); err != nil {
		return err
	}
	if o.Size, err = r.uint("offer.size"); err != nil {
		return err
	}
	if err := r.binN("offer.device_uuid", o.Device[:]); err != nil {
		return err
	}
	o.HasEvent = !r.isNil()
	if o.HasEvent {
		if err := r.binN("offer.event_handle", o.Event[:]); err != nil {
			return err
		}
	} else {
		o.Event = Handle{}
	}
	o.Meta = nil
	if !r.isNil() {
		start := r.off
		if m, ok := scanValue(r.b[r.off:]); ok {
			r.off += m
		} else if err := r.skip(1); err != nil {
			return fmt.Errorf("offer.meta: %w", err)
		}
		if r.off-start > MaxMetaSize {
			return malformed("offer.meta: %d bytes, limit %d", r.off-start, MaxMetaSize)
		}
		o.Meta = r.b[start:r.off:r.off]
	}
	nfds, err := r.uint("offer.nfds")
	if err != nil {
		return err
	}
	if nfds > MaxFDs {
		return malformed("offer.nfds: %d, limit %d", nfds, MaxFDs)
	}
	d.nfds = int(nfds)
	o.FDs = nil
	// The optional handle kind (section 4.1); absent is legacy IPC. A kind
	// this side does not know is the importer's to refuse: it names it.
	o.HandleKind = HandleIPC
	if n > offerFields {
		k, err := r.uint("offer.handle_kind")
		if err != nil {
			return err
		}
		o.HandleKind = HandleKind(min(k, math.MaxUint8))
	}
	return o.checkRange()
}

func (d *decoder) decodeRelease(r *reader, n int, m *Message) error {
	if err := needFields(KindRelease, n, releaseFields); err != nil {
		return err
	}
	ns, err := r.arrayLen("release.seqs")
	if err != nil {
		return err
	}
	if ns == 0 || ns > MaxReleaseSeqs {
		return malformed("release.seqs: %d sequence numbers, want 1..%d", ns, MaxReleaseSeqs)
	}
	for i := range ns {
		if d.seqs[i], err = r.uint("release.seqs"); err != nil {
			return err
		}
	}
	m.Seqs = d.seqs[:ns:ns]
	// The optional event (section 4): nil or bin(64).
	m.HasReleaseEvent = false
	if n > releaseFields && !r.isNil() {
		if err := r.binN("release.event_handle", m.ReleaseEvent[:]); err != nil {
			return err
		}
		m.HasReleaseEvent = true
	}
	return nil
}
