// Package events reads an mmis engine's cache events: vLLM's KV-events wire format and the
// multimodal stream beside it (server/mmis/protocol/kv_events.py, docs/ROUTING.md).
//
// Invariants:
//   - A batch is a msgpack array [ts, events, data_parallel_rank?]; each event is a map tagged
//     "type". Unknown event types and unknown fields are skipped, never an error: an engine
//     may add fields (always with defaults) and a picker must keep routing.
//   - Block hashes become opaque string keys: 32-byte digests as their bytes, 64-bit ints
//     (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) as 8 bytes big-endian. A key from P0's
//     /internal/block_keys (hex) decodes to the same bytes (HexKey).
package events

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
)

// Kind of one decoded event.
type Kind int

const (
	BlockStored Kind = iota
	BlockRemoved
	AllBlocksCleared
	EpochStarted
	ItemStored
	ItemEvicted
)

// Event is one KV or multimodal event, reduced to what an index needs.
type Event struct {
	Kind   Kind
	Blocks []string // BlockStored / BlockRemoved: the block keys
	Item   string   // ItemStored / ItemEvicted: the mm_hash
	Epoch  string   // EpochStarted
}

// Bounds on one batch (see msgpack.go for the reader's own invariants). A batch is one engine
// step's changes: its blocks are bounded by the tokens a step computes (thousands), so these
// leave two orders of magnitude of room and still bound what a hostile payload costs.
const (
	MaxBatchBytes  = 4 << 20 // a payload's size (also the ZMTP frame cap: transport.go)
	MaxEvents      = 1 << 16 // events in one batch
	MaxBlockHashes = 1 << 18 // block hashes over all of one batch's events
)

// Decode reads one batch payload (either stream).
//
// Invariants: the payload is walked once (wellFormed) before anything is allocated; what is
// then allocated is bounded by MaxEvents and MaxBlockHashes, whatever the payload claims; any
// input returns events or a *MalformedError, never a panic.
func Decode(payload []byte) ([]Event, error) {
	if err := wellFormed(payload); err != nil {
		return nil, err
	}
	r := mpReader{b: payload}
	h, err := r.head()
	if err != nil {
		return nil, err
	}
	if h.kind != mpArray || h.n < 2 {
		return nil, r.fail("batch is a %s of %d, want an array [ts, events, ...]", h.kind, h.n)
	}
	if err := r.skip(1); err != nil { // ts
		return nil, err
	}
	events, err := r.head()
	if err != nil {
		return nil, err
	}
	var out []Event
	switch {
	case events.kind == mpNil:
	case events.kind != mpArray:
		return nil, r.fail("batch events are a %s, want an array of maps", events.kind)
	case events.n > MaxEvents:
		return nil, r.fail("%d events in one batch, more than %d", events.n, MaxEvents)
	default:
		out = make([]Event, 0, events.n)
		budget := MaxBlockHashes
		for range events.n {
			ev, ok, err := r.event(&budget)
			if err != nil {
				return nil, err
			}
			if ok {
				out = append(out, ev)
			}
		}
	}
	return out, nil // the rest (the data-parallel rank) was checked by wellFormed
}

// event reads one event map. Fields are found first (a later duplicate wins, as in a map) and
// read after, so their order does not matter; unknown fields and event types are skipped.
func (r *mpReader) event(budget *int) (Event, bool, error) {
	h, err := r.head()
	if err != nil {
		return Event{}, false, err
	}
	if h.kind != mpMap {
		return Event{}, false, r.fail("an event is a %s, want a map", h.kind)
	}
	// offsets of the known fields' values (0: absent; a value never starts at byte 0)
	var typeAt, hashesAt, itemAt, epochAt int
	for range h.n {
		key, err := r.head()
		if err != nil {
			return Event{}, false, err
		}
		name, err := r.bytes(key)
		if err != nil {
			return Event{}, false, err
		}
		switch string(name) {
		case "type":
			typeAt = r.p
		case "block_hashes":
			hashesAt = r.p
		case "mm_hash":
			itemAt = r.p
		case "epoch":
			epochAt = r.p
		}
		if err := r.skip(3); err != nil { // batch > events > event > value
			return Event{}, false, err
		}
	}
	at := func(p int) *mpReader { return &mpReader{b: r.b, p: p} }
	var tag string
	if typeAt != 0 {
		tag, _ = at(typeAt).str() // a non-str type is an unknown event
	}
	switch tag {
	case "BlockStored", "BlockRemoved":
		kind := BlockStored
		if tag == "BlockRemoved" {
			kind = BlockRemoved
		}
		if hashesAt == 0 {
			return Event{}, false, r.fail("%s without block_hashes", tag)
		}
		keys, err := at(hashesAt).blockKeys(budget)
		if err != nil {
			return Event{}, false, err
		}
		return Event{Kind: kind, Blocks: keys}, true, nil
	case "AllBlocksCleared":
		return Event{Kind: AllBlocksCleared}, true, nil
	case "EpochStarted":
		var epoch string
		if epochAt != 0 {
			epoch, _ = at(epochAt).str() // a non-str epoch is the empty epoch
		}
		return Event{Kind: EpochStarted, Epoch: epoch}, true, nil
	case "MMItemStored", "MMItemEvicted":
		if itemAt == 0 {
			return Event{}, false, r.fail("%s without an mm_hash", tag)
		}
		item, err := at(itemAt).str()
		if err != nil {
			return Event{}, false, err
		}
		kind := ItemStored
		if tag == "MMItemEvicted" {
			kind = ItemEvicted
		}
		return Event{Kind: kind, Item: item}, true, nil
	default:
		return Event{}, false, nil
	}
}

// blockKeys reads block_hashes: an array of digests (bin or str) or integers.
func (r *mpReader) blockKeys(budget *int) ([]string, error) {
	h, err := r.head()
	if err != nil {
		return nil, err
	}
	if h.kind != mpArray {
		return nil, r.fail("block_hashes is a %s, want an array", h.kind)
	}
	if h.n > *budget {
		return nil, r.fail("more than %d block hashes in one batch", MaxBlockHashes)
	}
	*budget -= h.n
	keys := make([]string, 0, h.n)
	for range h.n {
		v, err := r.head()
		if err != nil {
			return nil, err
		}
		var b [8]byte
		switch v.kind {
		case mpStr, mpBin: // the digest's bytes (a str-typed value carries them too)
			raw, err := r.take(v.n)
			if err != nil {
				return nil, err
			}
			keys = append(keys, string(raw))
			continue
		case mpInt:
			binary.BigEndian.PutUint64(b[:], uint64(v.i))
		case mpUint:
			binary.BigEndian.PutUint64(b[:], v.u)
		default:
			return nil, r.fail("a block hash is a %s, want bytes or an integer", v.kind)
		}
		keys = append(keys, string(b[:]))
	}
	return keys, nil
}

// HexKey turns a hex block key (P0's /internal/block_keys) into an index key.
func HexKey(s string) (string, error) {
	b, err := hex.DecodeString(s)
	if err != nil {
		return "", fmt.Errorf("block key %q is not hex: %w", s, err)
	}
	return string(b), nil
}

// StartsLife reports whether a batch opens an engine's life on its stream: the KV stream's
// AllBlocksCleared or the multimodal stream's EpochStarted as its first event.
func StartsLife(evs []Event) bool {
	return len(evs) > 0 && (evs[0].Kind == AllBlocksCleared || evs[0].Kind == EpochStarted)
}
