package app

import (
	"bytes"
	"encoding/binary"

	"github.com/vmihailenco/msgpack/v5"
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
// a sender pick any), other keys ignored. ok is false without them.
func parseMeta(b []byte) (seq uint64, sentNS int64, ok bool) {
	dec := msgpack.NewDecoder(bytes.NewReader(b))
	n, err := dec.DecodeMapLen()
	if err != nil || n < 0 {
		return 0, 0, false
	}
	var haveSeq, haveT bool
	for range n {
		key, err := dec.DecodeString()
		if err != nil {
			return 0, 0, false
		}
		if key != "batch" && key != "t" {
			if dec.Skip() != nil {
				return 0, 0, false
			}
			continue
		}
		v, err := dec.DecodeInterfaceLoose()
		if err != nil {
			return 0, 0, false
		}
		var u uint64
		switch v := v.(type) {
		case uint64:
			u = v
		case int64:
			if v < 0 {
				return 0, 0, false
			}
			u = uint64(v)
		default:
			return 0, 0, false
		}
		if key == "batch" {
			seq, haveSeq = u, true
		} else {
			sentNS, haveT = int64(u), true
		}
	}
	if _, err := dec.DecodeInterfaceLoose(); err == nil {
		return 0, 0, false // bytes after the map
	}
	return seq, sentNS, haveSeq && haveT
}
