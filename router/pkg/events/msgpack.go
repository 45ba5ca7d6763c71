package events

import (
	"encoding/binary"
	"fmt"
)

// A bounded msgpack reader for the event batches (the only msgpack the picker reads from the
// network). It replaces vmihailenco/msgpack on this path: that decoder allocates what a
// length prefix claims before it has the bytes (`dd 04 00 00 00`, an array of 67M elements,
// took the picker to 1.58 GB) and recurses without a depth limit (2 MB of nested arrays
// overflowed the stack).
//
// Invariants:
//   - Every length is checked against the bytes left before it is used: a str/bin/ext of n
//     bytes needs n bytes, an array of n elements at least n bytes (each element is at least
//     one byte), a map of n pairs at least 2n. So nothing a payload claims can make a
//     reader allocate more than a fixed multiple of the payload's own size.
//   - Nesting deeper than MaxDepth is an error, never a deep recursion.
//   - The reader never panics on any input: every read is bounds-checked and returns an error.

// MaxDepth is the deepest nesting of arrays and maps a batch may have (a batch needs 4:
// batch > events > event > block_hashes; extra fields may nest a little more).
const MaxDepth = 16

// MalformedError is a batch that is not what an engine writes: where and why.
type MalformedError struct {
	At  int // byte offset in the payload
	Why string
}

func (e *MalformedError) Error() string {
	return fmt.Sprintf("malformed event batch at byte %d: %s", e.At, e.Why)
}

type mpKind uint8

const (
	mpNil mpKind = iota
	mpBool
	mpInt // negative or signed: value in i
	mpUint
	mpFloat
	mpStr // n bytes at the reader's position
	mpBin
	mpExt // n bytes of data (after its type byte) at the reader's position
	mpArray
	mpMap
)

var kindNames = [...]string{"nil", "bool", "int", "uint", "float", "str", "bin", "ext", "array", "map"}

func (k mpKind) String() string { return kindNames[k] }

// mpHead is one value's header: its kind, and its length (str, bin, ext: bytes; array:
// elements; map: pairs) or its integer value.
type mpHead struct {
	kind mpKind
	n    int
	i    int64
	u    uint64
}

type mpReader struct {
	b []byte
	p int
}

func (r *mpReader) fail(why string, args ...any) error {
	return &MalformedError{At: r.p, Why: fmt.Sprintf(why, args...)}
}

func (r *mpReader) left() int { return len(r.b) - r.p }

// take returns the next n bytes (n already checked to be >= 0).
func (r *mpReader) take(n int) ([]byte, error) {
	if n > r.left() {
		return nil, r.fail("%d bytes claimed, %d left", n, r.left())
	}
	out := r.b[r.p : r.p+n]
	r.p += n
	return out, nil
}

func (r *mpReader) uint(size int) (uint64, error) {
	b, err := r.take(size)
	if err != nil {
		return 0, err
	}
	switch size {
	case 1:
		return uint64(b[0]), nil
	case 2:
		return uint64(binary.BigEndian.Uint16(b)), nil
	case 4:
		return uint64(binary.BigEndian.Uint32(b)), nil
	default:
		return binary.BigEndian.Uint64(b), nil
	}
}

// length reads a size-byte length and checks that perItem * length bytes are left.
func (r *mpReader) length(size, perItem int) (int, error) {
	at := r.p
	v, err := r.uint(size)
	if err != nil {
		return 0, err
	}
	if v > uint64(r.left()/perItem) {
		left := r.left()
		r.p = at - 1 // reported at the value's type byte
		return 0, r.fail("a length of %d claimed with %d bytes left", v, left)
	}
	return int(v), nil
}

// head reads one value's header. For str, bin and ext the n bytes are still to be taken.
func (r *mpReader) head() (mpHead, error) {
	tb, err := r.take(1)
	if err != nil {
		return mpHead{}, err
	}
	c := tb[0]
	switch {
	case c <= 0x7f:
		return mpHead{kind: mpUint, u: uint64(c)}, nil
	case c >= 0xe0:
		return mpHead{kind: mpInt, i: int64(int8(c))}, nil
	case c&0xf0 == 0x80:
		return r.sized(mpMap, int(c&0x0f), 2)
	case c&0xf0 == 0x90:
		return r.sized(mpArray, int(c&0x0f), 1)
	case c&0xe0 == 0xa0:
		return r.sized(mpStr, int(c&0x1f), 1)
	}
	var h mpHead
	switch c {
	case 0xc0:
		return mpHead{kind: mpNil}, nil
	case 0xc2, 0xc3:
		return mpHead{kind: mpBool}, nil
	case 0xc4, 0xc5, 0xc6:
		h.kind = mpBin
		h.n, err = r.length(1<<(c-0xc4), 1)
	case 0xd9, 0xda, 0xdb:
		h.kind = mpStr
		h.n, err = r.length(1<<(c-0xd9), 1)
	case 0xc7, 0xc8, 0xc9: // ext 8/16/32: length, type byte, data
		h.kind = mpExt
		if h.n, err = r.length(1<<(c-0xc7), 1); err == nil {
			if h.n+1 > r.left() {
				return h, r.fail("ext of %d bytes with %d left", h.n, r.left())
			}
			r.p++ // the ext type
		}
	case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8: // fixext 1/2/4/8/16: type byte, data
		h.kind, h.n = mpExt, 1<<(c-0xd4)
		if h.n+1 > r.left() {
			return h, r.fail("fixext of %d bytes with %d left", h.n, r.left())
		}
		r.p++
	case 0xca, 0xcb:
		h.kind = mpFloat
		_, err = r.take(4 << (c - 0xca))
	case 0xcc, 0xcd, 0xce, 0xcf:
		h.kind = mpUint
		h.u, err = r.uint(1 << (c - 0xcc))
	case 0xd0, 0xd1, 0xd2, 0xd3:
		h.kind = mpInt
		var u uint64
		u, err = r.uint(1 << (c - 0xd0))
		switch c {
		case 0xd0:
			h.i = int64(int8(u))
		case 0xd1:
			h.i = int64(int16(u))
		case 0xd2:
			h.i = int64(int32(u))
		default:
			h.i = int64(u)
		}
	case 0xdc, 0xdd:
		h.kind = mpArray
		h.n, err = r.length(2<<(c-0xdc), 1)
	case 0xde, 0xdf:
		h.kind = mpMap
		h.n, err = r.length(2<<(c-0xde), 2)
	default: // 0xc1: never used
		r.p--
		return h, r.fail("byte 0x%02x is not a msgpack type", c)
	}
	return h, err
}

func (r *mpReader) sized(k mpKind, n, perItem int) (mpHead, error) {
	if n > r.left()/perItem {
		return mpHead{}, r.fail("a %s of %d claimed with %d bytes left", k, n, r.left())
	}
	return mpHead{kind: k, n: n}, nil
}

// skip reads past one whole value nested depth deep.
func (r *mpReader) skip(depth int) error {
	h, err := r.head()
	if err != nil {
		return err
	}
	return r.skipBody(h, depth)
}

// skipBody reads past the rest of a value whose header h was read at nesting depth.
func (r *mpReader) skipBody(h mpHead, depth int) error {
	switch h.kind {
	case mpStr, mpBin, mpExt:
		_, err := r.take(h.n)
		return err
	case mpArray, mpMap:
		if depth >= MaxDepth {
			return r.fail("nested deeper than %d", MaxDepth)
		}
		n := h.n
		if h.kind == mpMap {
			n *= 2
		}
		for range n {
			if err := r.skip(depth + 1); err != nil {
				return err
			}
		}
	}
	return nil
}

// bytes reads a str or bin value's bytes (a view of the payload).
func (r *mpReader) bytes(h mpHead) ([]byte, error) {
	if h.kind != mpStr && h.kind != mpBin {
		return nil, r.fail("%s where str or bin was expected", h.kind)
	}
	return r.take(h.n)
}

// str reads one value that must be a str.
func (r *mpReader) str() (string, error) {
	h, err := r.head()
	if err != nil {
		return "", err
	}
	if h.kind != mpStr {
		return "", r.fail("%s where str was expected", h.kind)
	}
	b, err := r.take(h.n)
	return string(b), err
}

// wellFormed walks the whole payload once: exactly one value, within MaxDepth, every length
// within the bytes left. Nothing is allocated.
func wellFormed(payload []byte) error {
	if len(payload) > MaxBatchBytes {
		return &MalformedError{Why: fmt.Sprintf("%d bytes, more than the %d a batch may have",
			len(payload), MaxBatchBytes)}
	}
	r := mpReader{b: payload}
	if err := r.skip(0); err != nil {
		return err
	}
	if r.left() != 0 {
		return r.fail("%d bytes after the batch", r.left())
	}
	return nil
}
