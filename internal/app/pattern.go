package app

import "encoding/binary"

// patternByte is the byte the producer fills batch seq with. It is never 0,
// so fresh (zeroed) memory never passes, and consecutive batches differ, so
// a buffer that still holds an older batch never passes either.
func patternByte(seq uint64) byte { return byte(seq%251) + 1 }

// metaSize is the size of the offer metadata below.
const metaSize = 19

// appendMeta writes the offer's metadata: the msgpack array [seq, sent_ns]
// with both as uint 64, the producer's batch number and its CLOCK_MONOTONIC
// reading at the offer. A fixed encoding costs nothing to write and any
// msgpack library reads it (a real producer would put shape and dtype here).
func appendMeta(b []byte, seq uint64, sentNS int64) []byte {
	b = append(b, 0x92, 0xcf)
	b = binary.BigEndian.AppendUint64(b, seq)
	b = append(b, 0xcf)
	return binary.BigEndian.AppendUint64(b, uint64(sentNS))
}

// parseMeta reads what appendMeta wrote.
func parseMeta(b []byte) (seq uint64, sentNS int64, ok bool) {
	if len(b) != metaSize || b[0] != 0x92 || b[1] != 0xcf || b[10] != 0xcf {
		return 0, 0, false
	}
	return binary.BigEndian.Uint64(b[2:]), int64(binary.BigEndian.Uint64(b[11:])), true
}
