package transport

import (
	"encoding/binary"
	"math"
	"unicode/utf8"
)

// The encoders append standard msgpack to a caller's buffer and never
// allocate once the buffer has grown. Integers use the smallest encoding, as
// every msgpack library does, so the bytes match what Python's msgpack.packb
// produces for the same values.

func beginFrame(b []byte) ([]byte, int) {
	return append(b, 0, 0, 0, 0), len(b)
}

func endFrame(b []byte, start int) []byte {
	binary.BigEndian.PutUint32(b[start:], uint32(len(b)-start-headerSize))
	return b
}

func appendArrayLen(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x90|byte(n))
	case n <= math.MaxUint16:
		return append(b, 0xdc, byte(n>>8), byte(n))
	default:
		return append(b, 0xdd, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
}

func appendUint(b []byte, v uint64) []byte {
	switch {
	case v < 128:
		return append(b, byte(v))
	case v <= math.MaxUint8:
		return append(b, 0xcc, byte(v))
	case v <= math.MaxUint16:
		return append(b, 0xcd, byte(v>>8), byte(v))
	case v <= math.MaxUint32:
		return append(b, 0xce, byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
	default:
		return append(b, 0xcf, byte(v>>56), byte(v>>48), byte(v>>40), byte(v>>32),
			byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
	}
}

func appendBin(b []byte, p []byte) []byte {
	switch n := len(p); {
	case n <= math.MaxUint8:
		b = append(b, 0xc4, byte(n))
	case n <= math.MaxUint16:
		b = append(b, 0xc5, byte(n>>8), byte(n))
	default:
		b = append(b, 0xc6, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
	return append(b, p...)
}

func appendStr(b []byte, s string) []byte {
	switch n := len(s); {
	case n < 32:
		b = append(b, 0xa0|byte(n))
	case n <= math.MaxUint8:
		b = append(b, 0xd9, byte(n))
	case n <= math.MaxUint16:
		b = append(b, 0xda, byte(n>>8), byte(n))
	default:
		b = append(b, 0xdb, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
	return append(b, s...)
}

const mpNil = 0xc0

func appendHello(b []byte, h *hello) []byte {
	b, start := beginFrame(b)
	if h.session != 0 {
		b = appendArrayLen(b, helloSessionFields)
	} else {
		b = appendArrayLen(b, helloFields)
	}
	b = appendUint(b, uint64(h.kind))
	b = appendUint(b, h.version)
	b = appendUint(b, uint64(h.role))
	b = appendUint(b, h.pid)
	b = appendBin(b, h.instanceID[:])
	b = appendArrayLen(b, len(h.devices))
	for i := range h.devices {
		b = appendBin(b, h.devices[i][:])
	}
	b = appendUint(b, uint64(h.caps))
	b = appendUint(b, h.credits)
	if h.session != 0 {
		b = appendUint(b, h.session)
	}
	return endFrame(b, start)
}

// appendOffer encodes o, which the caller has checked with o.check.
func appendOffer(b []byte, o *Offer) []byte {
	b, start := beginFrame(b)
	if o.HandleKind == HandleIPC {
		// The legacy form, which every version 1 peer reads.
		b = appendArrayLen(b, offerFields)
	} else {
		b = appendArrayLen(b, offerKindFields)
	}
	b = append(b, byte(KindOffer))
	b = appendUint(b, o.Seq)
	b = appendUint(b, o.AllocID)
	b = appendUint(b, o.Generation)
	b = appendBin(b, o.Handle[:])
	b = appendUint(b, o.AllocSize)
	b = appendUint(b, o.Offset)
	b = appendUint(b, o.Size)
	b = appendBin(b, o.Device[:])
	if o.HasEvent {
		b = appendBin(b, o.Event[:])
	} else {
		b = append(b, mpNil)
	}
	if len(o.Meta) == 0 {
		b = append(b, mpNil)
	} else {
		b = append(b, o.Meta...)
	}
	b = appendUint(b, uint64(len(o.FDs)))
	if o.HandleKind != HandleIPC {
		b = appendUint(b, uint64(o.HandleKind))
	}
	return endFrame(b, start)
}

func appendRelease(b []byte, seqs []uint64, ev *Handle) []byte {
	b, start := beginFrame(b)
	if ev == nil {
		b = appendArrayLen(b, releaseFields)
	} else {
		b = appendArrayLen(b, releaseEventFields)
	}
	b = append(b, byte(KindRelease))
	b = appendArrayLen(b, len(seqs))
	for _, s := range seqs {
		b = appendUint(b, s)
	}
	if ev != nil {
		b = appendBin(b, ev[:])
	}
	return endFrame(b, start)
}

// appendUintMsg encodes the two-element messages retire, closed and credit.
func appendUintMsg(b []byte, k Kind, v uint64) []byte {
	b, start := beginFrame(b)
	b = append(b, 0x92, byte(k))
	b = appendUint(b, v)
	return endFrame(b, start)
}

// appendGoodbye encodes a goodbye; the code travels only when it says
// more than the default, so that a plain goodbye stays as it always was.
func appendGoodbye(b []byte, code GoodbyeCode, reason string) []byte {
	b, start := beginFrame(b)
	if code == GoodbyeDone {
		b = append(b, 0x92, byte(KindGoodbye))
	} else {
		b = append(b, 0x93, byte(KindGoodbye))
	}
	b = appendStr(b, truncateText(reason))
	if code != GoodbyeDone {
		b = appendUint(b, uint64(code))
	}
	return endFrame(b, start)
}

func appendError(b []byte, code uint32, text string) []byte {
	b, start := beginFrame(b)
	b = append(b, 0x93, byte(KindError))
	b = appendUint(b, uint64(code))
	b = appendStr(b, truncateText(text))
	return endFrame(b, start)
}

// truncateText cuts s to maxTextLen bytes on a rune boundary and replaces
// invalid UTF-8, so that what we send is a valid msgpack str.
func truncateText(s string) string {
	if len(s) <= maxTextLen && utf8.ValidString(s) {
		return s
	}
	s = string([]rune(s)) // replaces invalid bytes with U+FFFD
	for len(s) > maxTextLen {
		_, n := utf8.DecodeLastRuneInString(s)
		s = s[:len(s)-n]
	}
	return s
}
