package app

import (
	"encoding/binary"
)

// patternByte is the byte the producer fills batch seq with. It is never 0,
// so fresh (zeroed) memory never passes, and consecutive batches differ, so
// a buffer that still holds an older batch never passes either.
// PROTOCOL.md section 4.2 documents it for peers in other languages.
func patternByte(seq uint64) byte { return byte(seq%251) + 1 }

// appendMeta writes the offer's metadata, the map of PROTOCOL.md section
// 4.2: {"batch": seq, "t": sent_ns, "dtype": "uint8", "shape": [size]},
// the producer's batch number, its CLOCK_MONOTONIC reading at the offer,
// and the view a consumer's framework makes of the buffer (bytes). Integers
// take msgpack's smallest encoding, as every msgpack library writes them.
func appendMeta(b []byte, seq uint64, sentNS int64, size uint64) []byte {
	b = append(b, 0x84)
	b = appendMetaStr(b, "batch")
	b = appendMetaUint(b, seq)
	b = appendMetaStr(b, "t")
	b = appendMetaUint(b, uint64(sentNS))
	b = appendMetaStr(b, "dtype")
	b = appendMetaStr(b, "uint8")
	b = appendMetaStr(b, "shape")
	b = append(b, 0x91)
	return appendMetaUint(b, size)
}

// appendMetaStr appends s, shorter than 32 bytes, as a fixstr.
func appendMetaStr(b []byte, s string) []byte {
	return append(append(b, 0xa0|byte(len(s))), s...)
}

// appendMetaUint appends v in msgpack's smallest unsigned encoding.
func appendMetaUint(b []byte, v uint64) []byte {
	switch {
	case v < 0x80:
		return append(b, byte(v))
	case v <= 0xff:
		return append(b, 0xcc, byte(v))
	case v <= 0xffff:
		return binary.BigEndian.AppendUint16(append(b, 0xcd), uint16(v))
	case v <= 0xffffffff:
		return binary.BigEndian.AppendUint32(append(b, 0xce), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xcf), v)
}

// parseMeta reads the batch number and send time from an offer's metadata:
// a msgpack map with the integer keys "batch" and "t", in any integer
// encoding a msgpack library may have chosen (PROTOCOL.md section 2.1 lets
// a sender pick any), other keys ignored. ok is false without them. It
// runs once per batch, so it scans the bytes in place and allocates
// nothing (a msgpack.Decoder per batch was a tenth of the consumer's CPU
// in the handoff benchmark).
func parseMeta(b []byte) (seq uint64, sentNS int64, ok bool) {
	s := metaScan{b: b}
	n := s.mapLen()
	var haveSeq, haveT bool
	for ; n > 0 && !s.bad; n-- {
		switch string(s.str()) {
		case "batch":
			seq, haveSeq = s.uint()
		case "t":
			var u uint64
			u, haveT = s.uint()
			sentNS = int64(u)
		default:
			s.skip(0)
		}
	}
	return seq, sentNS, haveSeq && haveT && !s.bad && s.i == len(b)
}

// metaScan reads msgpack values from b in place. A value that is
// malformed, cut short or of another type than asked sets bad, after which
// every read returns zero values.
type metaScan struct {
	b   []byte
	i   int
	bad bool
}

// take returns the next n bytes.
func (s *metaScan) take(n uint64) []byte {
	if s.bad || n > uint64(len(s.b)-s.i) {
		s.bad = true
		return nil
	}
	p := s.b[s.i : s.i+int(n)]
	s.i += int(n)
	return p
}

// be reads an n-byte big-endian unsigned integer (n is 1, 2, 4 or 8).
func (s *metaScan) be(n uint64) uint64 {
	var v uint64
	for _, c := range s.take(n) {
		v = v<<8 | uint64(c)
	}
	return v
}

func (s *metaScan) code() byte {
	if p := s.take(1); p != nil {
		return p[0]
	}
	return 0xc1 // never used by msgpack
}

func (s *metaScan) mapLen() uint64 {
	switch c := s.code(); {
	case c >= 0x80 && c <= 0x8f:
		return uint64(c & 0x0f)
	case c == 0xde:
		return s.be(2)
	case c == 0xdf:
		return s.be(4)
	}
	s.bad = true
	return 0
}

// str returns a str value's bytes.
func (s *metaScan) str() []byte {
	switch c := s.code(); {
	case c >= 0xa0 && c <= 0xbf:
		return s.take(uint64(c & 0x1f))
	case c >= 0xd9 && c <= 0xdb:
		return s.take(s.be(1 << (c - 0xd9)))
	}
	s.bad = true
	return nil
}

// uint returns a non-negative integer in any encoding; ok is false for
// anything else, which also sets bad.
func (s *metaScan) uint() (v uint64, ok bool) {
	switch c := s.code(); {
	case c <= 0x7f:
		return uint64(c), true
	case c >= 0xcc && c <= 0xcf:
		v = s.be(1 << (c - 0xcc))
	case c >= 0xd0 && c <= 0xd3:
		n := uint64(1) << (c - 0xd0)
		v = s.be(n)
		if v>>(8*n-1) != 0 { // negative
			s.bad = true
		}
	default:
		s.bad = true
	}
	return v, !s.bad
}

// skip steps over one value of any type but ext.
func (s *metaScan) skip(depth int) {
	if depth > 16 {
		s.bad = true
		return
	}
	c := s.code()
	var n uint64 // payload bytes
	switch {
	case c <= 0x7f, c >= 0xe0, c == 0xc0, c == 0xc2, c == 0xc3:
		return
	case c >= 0x80 && c <= 0x8f:
		s.skipN(2*uint64(c&0x0f), depth)
		return
	case c >= 0x90 && c <= 0x9f:
		s.skipN(uint64(c&0x0f), depth)
		return
	case c >= 0xa0 && c <= 0xbf:
		n = uint64(c & 0x1f)
	case c >= 0xc4 && c <= 0xc6: // bin 8/16/32
		n = s.be(1 << (c - 0xc4))
	case c == 0xca:
		n = 4
	case c == 0xcb:
		n = 8
	case c >= 0xcc && c <= 0xcf:
		n = 1 << (c - 0xcc)
	case c >= 0xd0 && c <= 0xd3:
		n = 1 << (c - 0xd0)
	case c >= 0xd9 && c <= 0xdb: // str 8/16/32
		n = s.be(1 << (c - 0xd9))
	case c == 0xdc, c == 0xdd: // array 16/32
		s.skipN(s.be(2<<(c-0xdc)), depth)
		return
	case c == 0xde, c == 0xdf: // map 16/32: keys and values
		s.skipN(2*s.be(2<<(c-0xde)), depth)
		return
	default: // ext types and 0xc1
		s.bad = true
		return
	}
	s.take(n)
}

// skipN steps over n values, each at least one byte.
func (s *metaScan) skipN(n uint64, depth int) {
	if n > uint64(len(s.b)-s.i) {
		s.bad = true
		return
	}
	for ; n > 0 && !s.bad; n-- {
		s.skip(depth + 1)
	}
}
