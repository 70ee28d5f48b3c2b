//go:build linux

package share

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"sort"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/seed743c36cf/cudashare/transport"
)

// Metadata travels with an offer as one msgpack value (OfferOptions.Meta,
// Lease.Meta), so that consumers in any language read it. EncodeMeta and
// DecodeMeta convert Go values; ViewMeta is the dtype and shape convention
// of PROTOCOL.md section 4.2, which the Python consumer also reads.

// ErrMeta: metadata that cannot be encoded, decoded, or read as a view
// (PROTOCOL.md, section 4.2). The message says what is wrong.
var ErrMeta = errors.New("share: metadata")

// maxMetaDepth is the transport's nesting limit for metadata.
const maxMetaDepth = 16

// EncodeMeta encodes v as offer metadata: one msgpack value of at most
// transport.MaxMetaSize bytes, built of what the protocol allows (nil,
// bool, integers, floats, strings, bytes, arrays, maps with string keys,
// nested at most 16 deep). Structs encode as maps keyed by field name (or
// the `msgpack:"name"` tag); map keys are sorted, integers take their
// smallest form. An ViewMeta encodes as the section 4.2 map.
func EncodeMeta(v any) ([]byte, error) {
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.UseCompactInts(true)
	enc.SetSortMapKeys(true)
	if err := enc.Encode(v); err != nil {
		return nil, fmt.Errorf("%w: encode %T: %v", ErrMeta, v, err)
	}
	b := buf.Bytes()
	if len(b) > transport.MaxMetaSize {
		return nil, fmt.Errorf("%w: %T encodes to %d bytes, limit %d (transport.MaxMetaSize): send a key to data kept elsewhere",
			ErrMeta, v, len(b), transport.MaxMetaSize)
	}
	// Check what the encoder made against the protocol's rules, so that the
	// error comes here, naming the value, and not from Offer.
	dec := msgpack.NewDecoder(bytes.NewReader(b))
	dec.UseLooseInterfaceDecoding(true)
	back, err := dec.DecodeInterface()
	if err != nil {
		return nil, fmt.Errorf("%w: %T encodes to something the protocol does not carry (an extension type such as time.Time?): %v", ErrMeta, v, err)
	}
	if err := checkPlain(back, 1); err != nil {
		return nil, fmt.Errorf("%w: %T: %v", ErrMeta, v, err)
	}
	return b, nil
}

// checkPlain checks a decoded value against the protocol's JSON-like
// types and depth.
func checkPlain(v any, depth int) error {
	if depth > maxMetaDepth {
		return fmt.Errorf("nested more than %d deep", maxMetaDepth)
	}
	switch x := v.(type) {
	case nil, bool, int64, uint64, float32, float64, string, []byte:
		return nil
	case []any:
		for _, e := range x {
			if err := checkPlain(e, depth+1); err != nil {
				return err
			}
		}
		return nil
	case map[string]any:
		for _, e := range x {
			if err := checkPlain(e, depth+1); err != nil {
				return err
			}
		}
		return nil
	}
	return fmt.Errorf("a %T is not a type the protocol carries (nil, bool, number, string, bytes, array, map with string keys)", v)
}

// DecodeMeta decodes metadata b (Lease.Meta) into v, a pointer, as
// msgpack.Unmarshal does. Empty metadata, JSON where msgpack belongs, and
// bytes after the value are errors that say so.
func DecodeMeta(b []byte, v any) error {
	if len(b) == 0 {
		return fmt.Errorf("%w: the offer carries no metadata", ErrMeta)
	}
	r := bytes.NewReader(b)
	dec := msgpack.NewDecoder(r)
	err := dec.Decode(v)
	if err == nil && r.Len() > 0 {
		err = fmt.Errorf("%d bytes after the msgpack value", r.Len())
	}
	if err != nil {
		if looksJSON(b) {
			return fmt.Errorf("%w: meta is JSON, not msgpack: use share.EncodeMeta on the producer", ErrMeta)
		}
		return fmt.Errorf("%w: decode %d bytes into %T: %v", ErrMeta, len(b), v, err)
	}
	return nil
}

// looksJSON: a JSON object or array. (A JSON number or string could also be
// msgpack; an object or array never is one msgpack value: '{' and '[' are
// one-byte integers with bytes after them.)
func looksJSON(b []byte) bool {
	t := bytes.TrimSpace(b)
	return len(t) > 1 && (t[0] == '{' || t[0] == '[') && json.Valid(t)
}

// ViewMeta is offer metadata that describes the buffer's view, its element
// type and shape, in the convention of PROTOCOL.md section 4.2: a map with
// "dtype" and "shape", and the application's own keys beside them. EncodeMeta and
// DecodeMeta read and write it as that map.
type ViewMeta struct {
	// DType is the element type: "uint8", "float32", ... (the names of
	// section 4.2). Empty: not sent; readers take uint8.
	DType string
	// Shape is the dimensions, row-major and contiguous. Nil: not sent;
	// readers take [size / itemsize].
	Shape []uint64
	// Extra holds the other keys ("batch", ...); they must not be "dtype"
	// or "shape".
	Extra map[string]any
}

var (
	_ msgpack.CustomEncoder = ViewMeta{}
	_ msgpack.CustomDecoder = (*ViewMeta)(nil)
)

// EncodeMsgpack implements msgpack.CustomEncoder: one map, keys sorted.
func (a ViewMeta) EncodeMsgpack(enc *msgpack.Encoder) error {
	m := make(map[string]any, len(a.Extra)+2)
	for k, v := range a.Extra {
		if k == "dtype" || k == "shape" {
			return fmt.Errorf("ViewMeta.Extra has the key %q: set the field instead", k)
		}
		m[k] = v
	}
	if a.DType != "" {
		if _, ok := dtypeSize[a.DType]; !ok {
			return fmt.Errorf("unknown dtype %q (%s)", a.DType, knownDTypes())
		}
		m["dtype"] = a.DType
	}
	if a.Shape != nil {
		m["shape"] = a.Shape
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	if err := enc.EncodeMapLen(len(keys)); err != nil {
		return err
	}
	for _, k := range keys {
		if err := enc.EncodeString(k); err != nil {
			return err
		}
		if err := enc.Encode(m[k]); err != nil {
			return err
		}
	}
	return nil
}

// DecodeMsgpack implements msgpack.CustomDecoder. A value that is not a
// map decodes as no dtype and no shape; a dtype that is not a string or a
// shape that is not an array of non-negative integers is an error.
func (a *ViewMeta) DecodeMsgpack(dec *msgpack.Decoder) error {
	v, err := dec.DecodeInterface()
	if err != nil {
		return err
	}
	*a = ViewMeta{}
	m, ok := v.(map[string]any)
	if !ok {
		return nil
	}
	for k, x := range m {
		switch k {
		case "dtype":
			s, ok := x.(string)
			if !ok {
				return fmt.Errorf("dtype is a %T, not a string", x)
			}
			a.DType = s
		case "shape":
			arr, ok := x.([]any)
			if !ok {
				return fmt.Errorf("shape is a %T, not an array", x)
			}
			a.Shape = make([]uint64, len(arr))
			for i, d := range arr {
				n, err := dimension(d)
				if err != nil {
					return fmt.Errorf("shape[%d]: %v", i, err)
				}
				a.Shape[i] = n
			}
		default:
			if a.Extra == nil {
				a.Extra = make(map[string]any)
			}
			a.Extra[k] = x
		}
	}
	return nil
}

// dimension is a decoded msgpack integer, of whichever width the encoder
// chose, as a dimension.
func dimension(v any) (uint64, error) {
	var n int64
	switch x := v.(type) {
	case uint64:
		return x, nil
	case uint32:
		return uint64(x), nil
	case uint16:
		return uint64(x), nil
	case uint8:
		return uint64(x), nil
	case int64:
		n = x
	case int32:
		n = int64(x)
	case int16:
		n = int64(x)
	case int8:
		n = int64(x)
	default:
		return 0, fmt.Errorf("a %T, not an integer", v)
	}
	if n < 0 {
		return 0, fmt.Errorf("%d, negative", n)
	}
	return uint64(n), nil
}

// dtypeSize is the item size of each dtype of section 4.2.
var dtypeSize = map[string]uint64{
	"bool": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
	"uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
	"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
	"complex64": 8, "complex128": 16,
}

func knownDTypes() string {
	names := make([]string, 0, len(dtypeSize))
	for k := range dtypeSize {
		names = append(names, k)
	}
	sort.Strings(names)
	return fmt.Sprintf("known: %v", names)
}

// viewOf reads meta as a view of size bytes by section 4.2: the dtype
// (uint8 without one) must be known and the shape ([size/itemsize] without
// one) must fit in size.
func viewOf(meta []byte, size uint64) (string, []uint64, error) {
	var a ViewMeta
	if len(meta) > 0 {
		if err := DecodeMeta(meta, &a); err != nil {
			return "", nil, err
		}
	}
	if a.DType == "" {
		a.DType = "uint8"
	}
	item, ok := dtypeSize[a.DType]
	if !ok {
		return "", nil, fmt.Errorf("%w: unknown dtype %q (%s)", ErrMeta, a.DType, knownDTypes())
	}
	if a.Shape == nil {
		return a.DType, []uint64{size / item}, nil
	}
	n := item
	for _, d := range a.Shape {
		hi, lo := bits.Mul64(n, d)
		if hi != 0 || lo > math.MaxInt64 {
			return "", nil, fmt.Errorf("%w: shape %v of %s overflows", ErrMeta, a.Shape, a.DType)
		}
		n = lo
	}
	if n > size {
		return "", nil, fmt.Errorf("%w: shape %v of %s is %d bytes, the buffer %d", ErrMeta, a.Shape, a.DType, n, size)
	}
	return a.DType, a.Shape, nil
}

// DecodeMeta decodes the lease's metadata into v (see the package-level
// DecodeMeta).
func (l *Lease) DecodeMeta(v any) error { return DecodeMeta(l.meta, v) }

// View reads the lease's metadata as a view (PROTOCOL.md, section 4.2):
// its element type and shape. Without metadata, or without the keys, the
// buffer is uint8 of its size. An unknown dtype, or a shape larger than the
// buffer, is an error matching ErrMeta; the lease stays valid (and must
// still be released).
func (l *Lease) View() (dtype string, shape []uint64, err error) {
	return viewOf(l.meta, l.size)
}
