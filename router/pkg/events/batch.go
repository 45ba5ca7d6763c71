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

	"github.com/vmihailenco/msgpack/v5"
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

// Decode reads one batch payload (either stream).
func Decode(payload []byte) ([]Event, error) {
	var batch []msgpack.RawMessage
	if err := msgpack.Unmarshal(payload, &batch); err != nil {
		return nil, fmt.Errorf("batch is not a msgpack array: %w", err)
	}
	if len(batch) < 2 {
		return nil, fmt.Errorf("batch has %d fields, want [ts, events, ...]", len(batch))
	}
	var raw []map[string]any
	if err := msgpack.Unmarshal(batch[1], &raw); err != nil {
		return nil, fmt.Errorf("batch events are not an array of maps: %w", err)
	}
	out := make([]Event, 0, len(raw))
	for _, m := range raw {
		ev, ok, err := decodeEvent(m)
		if err != nil {
			return nil, err
		}
		if ok {
			out = append(out, ev)
		}
	}
	return out, nil
}

func decodeEvent(m map[string]any) (Event, bool, error) {
	tag, _ := m["type"].(string)
	switch tag {
	case "BlockStored", "BlockRemoved":
		keys, err := blockKeys(m["block_hashes"])
		kind := BlockStored
		if tag == "BlockRemoved" {
			kind = BlockRemoved
		}
		return Event{Kind: kind, Blocks: keys}, err == nil, err
	case "AllBlocksCleared":
		return Event{Kind: AllBlocksCleared}, true, nil
	case "EpochStarted":
		epoch, _ := m["epoch"].(string)
		return Event{Kind: EpochStarted, Epoch: epoch}, true, nil
	case "MMItemStored", "MMItemEvicted":
		item, ok := m["mm_hash"].(string)
		if !ok {
			return Event{}, false, fmt.Errorf("%s without a string mm_hash", tag)
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

func blockKeys(v any) ([]string, error) {
	list, ok := v.([]any)
	if !ok {
		return nil, fmt.Errorf("block_hashes is %T, want an array", v)
	}
	keys := make([]string, 0, len(list))
	for _, h := range list {
		key, err := blockKey(h)
		if err != nil {
			return nil, err
		}
		keys = append(keys, key)
	}
	return keys, nil
}

func blockKey(h any) (string, error) {
	var b [8]byte
	switch x := h.(type) {
	case []byte:
		return string(x), nil
	case string: // a str-typed msgpack value carrying the digest bytes
		return x, nil
	case int64:
		binary.BigEndian.PutUint64(b[:], uint64(x))
	case uint64:
		binary.BigEndian.PutUint64(b[:], x)
	case int8, int16, int32, uint8, uint16, uint32:
		binary.BigEndian.PutUint64(b[:], uint64(toInt64(x)))
	default:
		return "", fmt.Errorf("block hash is %T, want bytes or an integer", h)
	}
	return string(b[:]), nil
}

func toInt64(v any) int64 {
	switch x := v.(type) {
	case int8:
		return int64(x)
	case int16:
		return int64(x)
	case int32:
		return int64(x)
	case uint8:
		return int64(x)
	case uint16:
		return int64(x)
	case uint32:
		return int64(x)
	}
	return 0
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
