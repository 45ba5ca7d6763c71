package events

import (
	"encoding/binary"
	"os"
	"strings"
	"testing"
)

// The golden batches are written by server/mmis/protocol/kv_events.py, whose KV bytes are
// checked against vLLM's own encoder (tests/engine/test_kv_events.py); tests/routing checks
// that these files still equal what that encoder writes.
func golden(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile("testdata/" + name)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestDecodeKVBatch(t *testing.T) {
	evs, err := Decode(golden(t, "kv_batch.msgpack"))
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 4 {
		t.Fatalf("got %d events, want 4", len(evs))
	}
	if !StartsLife(evs) {
		t.Error("a batch opening with AllBlocksCleared starts a life")
	}
	one, two := strings.Repeat("\x01", 32), strings.Repeat("\x02", 32)
	if evs[1].Kind != BlockStored || len(evs[1].Blocks) != 2 || evs[1].Blocks[0] != one || evs[1].Blocks[1] != two {
		t.Errorf("BlockStored decoded as %+v", evs[1])
	}
	if evs[2].Kind != BlockRemoved || len(evs[2].Blocks) != 1 || evs[2].Blocks[0] != one {
		t.Errorf("BlockRemoved decoded as %+v", evs[2])
	}
	var seven [8]byte
	binary.BigEndian.PutUint64(seven[:], 7)
	if evs[3].Blocks[0] != string(seven[:]) {
		t.Errorf("an integer block hash becomes 8 bytes big-endian, got %q", evs[3].Blocks[0])
	}
	x := NewIndex()
	x.ApplyKV(evs)
	if n := x.Prefix([]string{two}); n != 1 {
		t.Errorf("prefix of a held block = %d, want 1", n)
	}
	if n := x.Prefix([]string{one, two}); n != 0 {
		t.Errorf("a removed first block ends the prefix at 0, got %d", n)
	}
}

func TestDecodeMMBatch(t *testing.T) {
	evs, err := Decode(golden(t, "mm_batch.msgpack"))
	if err != nil {
		t.Fatal(err)
	}
	if !StartsLife(evs) || evs[0].Epoch != "e1" {
		t.Fatalf("first event %+v, want EpochStarted e1", evs[0])
	}
	x := NewIndex()
	x.ApplyMM(evs)
	if got := x.Items([]string{"h1", "h2"}); got != 1 {
		t.Errorf("items held = %d, want 1 (h1 evicted, h2 stored)", got)
	}
	x.ApplyMM([]Event{{Kind: EpochStarted, Epoch: "e2"}})
	if b, i, e := x.Sizes(); b != 0 || i != 0 || e != "e2" {
		t.Errorf("a new epoch empties the items: blocks=%d items=%d epoch=%q", b, i, e)
	}
}

func TestDecodeRejectsGarbage(t *testing.T) {
	for _, bad := range [][]byte{{0xc1}, {0x91, 0x01}, {0x92, 0x01, 0x91, 0x81, 0xa4, 't', 'y', 'p', 'e', 0xab,
		'B', 'l', 'o', 'c', 'k', 'S', 't', 'o', 'r', 'e', 'd'}} {
		if _, err := Decode(bad); err == nil {
			t.Errorf("Decode(% x) did not fail", bad)
		}
	}
}

func TestUnknownEventsAreSkipped(t *testing.T) {
	// [0.0, [{"type": "Future"}]]
	evs, err := Decode([]byte{0x92, 0x00, 0x91, 0x81, 0xa4, 't', 'y', 'p', 'e', 0xa6, 'F', 'u', 't', 'u', 'r', 'e'})
	if err != nil || len(evs) != 0 {
		t.Fatalf("unknown event: %v, %v", evs, err)
	}
}
