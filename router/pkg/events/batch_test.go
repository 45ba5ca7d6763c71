package events

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"reflect"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"
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

// hostile are payloads that crashed or bloated the picker with vmihailenco/msgpack's decoder
// (issue 41), and their relatives: each must be an error, in bounded memory and time.
func hostile() map[string][]byte {
	nested := func(open byte, n int) []byte { return bytes.Repeat([]byte{open}, n) }
	return map[string][]byte{
		"array32 of 67M elements":   {0xdd, 0x04, 0x00, 0x00, 0x00},
		"array32 of 4G elements":    {0xdd, 0xff, 0xff, 0xff, 0xff, 0x01},
		"map32 of 4G pairs":         {0xdf, 0xff, 0xff, 0xff, 0xff, 0x01, 0x01},
		"str32 of 4 GB":             {0xdb, 0xff, 0xff, 0xff, 0xff, 'a'},
		"bin32 of 4 GB":             {0xc6, 0xff, 0xff, 0xff, 0xff, 'a'},
		"ext32 of 4 GB":             {0xc9, 0xff, 0xff, 0xff, 0xff, 0x01, 'a'},
		"2 MB of nested arrays":     nested(0x91, 2<<20),
		"2 MB of nested maps":       bytes.Repeat([]byte{0x81, 0xa1, 'k'}, (2<<20)/3),
		"events claiming 67M":       {0x92, 0x00, 0xdd, 0x04, 0x00, 0x00, 0x00},
		"block_hashes claiming 67M": append([]byte{0x92, 0x00, 0x91, 0x82, 0xa4, 't', 'y', 'p', 'e', 0xab, 'B', 'l', 'o', 'c', 'k', 'S', 't', 'o', 'r', 'e', 'd', 0xac, 'b', 'l', 'o', 'c', 'k', '_', 'h', 'a', 's', 'h', 'e', 's'}, 0xdd, 0x04, 0x00, 0x00, 0x00),
		"fixarray past the end":     {0x9f, 0x00},
		"the never-used byte":       {0xc1},
		"trailing bytes":            {0x92, 0x00, 0x90, 0x00},
		"empty":                     {},
	}
}

func TestHostilePayloadsFailInBoundedMemory(t *testing.T) {
	for name, payload := range hostile() {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		start := time.Now()
		evs, err := Decode(payload)
		took := time.Since(start)
		runtime.ReadMemStats(&after)
		var malformed *MalformedError
		if err == nil || !errors.As(err, &malformed) {
			t.Errorf("%s: Decode = %v, %v; want a *MalformedError", name, evs, err)
		}
		if grew := after.TotalAlloc - before.TotalAlloc; grew > 64<<10 {
			t.Errorf("%s: allocated %d bytes for a %d-byte payload", name, grew, len(payload))
		}
		if took > time.Second {
			t.Errorf("%s: took %s", name, took)
		}
	}
	// a length is refused where it is read, saying what was claimed
	_, err := Decode([]byte{0x92, 0x00, 0xdd, 0x04, 0x00, 0x00, 0x00, 0x90})
	if err == nil || !strings.Contains(err.Error(), "at byte 2: a length of 67108864 claimed with 1 bytes left") {
		t.Errorf("an array claiming 67M elements: %v", err)
	}
}

func TestOverLargeBatchesAreRefused(t *testing.T) {
	// [0, [], <a bin of MaxBatchBytes>]: well formed, one payload too large
	big := binary.BigEndian.AppendUint32([]byte{0x93, 0x00, 0x90, 0xc6}, MaxBatchBytes)
	big = append(big, make([]byte, MaxBatchBytes)...)
	if _, err := Decode(big); err == nil {
		t.Error("a payload over MaxBatchBytes was decoded")
	}
	many := func(hashes int) []byte { // one BlockStored with `hashes` fixint hashes
		b := []byte{0x92, 0x00, 0x91, 0x82, 0xa4, 't', 'y', 'p', 'e', 0xab}
		b = append(b, "BlockStored"...)
		b = append(b, 0xac)
		b = append(b, "block_hashes"...)
		b = append(b, 0xdd, 0, 0, 0, 0)
		binary.BigEndian.PutUint32(b[len(b)-4:], uint32(hashes))
		return append(b, bytes.Repeat([]byte{0x07}, hashes)...)
	}
	if evs, err := Decode(many(MaxBlockHashes)); err != nil || len(evs[0].Blocks) != MaxBlockHashes {
		t.Errorf("MaxBlockHashes hashes: %v", err)
	}
	if _, err := Decode(many(MaxBlockHashes + 1)); err == nil {
		t.Error("more than MaxBlockHashes hashes in one batch were decoded")
	}
	events := []byte{0x92, 0x00, 0xdd, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(events[3:], MaxEvents+1)
	events = append(events, bytes.Repeat([]byte{0x80}, MaxEvents+1)...)
	if _, err := Decode(events); err == nil {
		t.Error("more than MaxEvents events in one batch were decoded")
	}
}

func TestALaterDuplicateFieldWins(t *testing.T) {
	// [0, [{"block_hashes": [1], "type": "BlockStored", "block_hashes": [2]}]]
	payload := []byte{0x92, 0x00, 0x91, 0x83, 0xac}
	payload = append(payload, "block_hashes"...)
	payload = append(payload, 0x91, 0x01, 0xa4, 't', 'y', 'p', 'e', 0xab)
	payload = append(payload, "BlockStored"...)
	payload = append(payload, 0xac)
	payload = append(payload, "block_hashes"...)
	payload = append(payload, 0x91, 0x02)
	evs, err := Decode(payload)
	if err != nil || len(evs) != 1 || evs[0].Blocks[0] != "\x00\x00\x00\x00\x00\x00\x00\x02" {
		t.Fatalf("decoded %+v, %v; want the second block_hashes", evs, err)
	}
}

func TestFieldsInAnyOrderAndNestedExtrasSkipped(t *testing.T) {
	payload, err := msgpack.Marshal([]any{1.0, []any{
		map[string]any{"extra": map[string]any{"x": []any{[]any{1, "y"}, nil}},
			"block_hashes": []any{int64(-1), uint64(1 << 63), []byte("digest")}, "type": "BlockRemoved"},
		map[string]any{"type": "MMItemStored", "mm_hash": "h", "nbytes": 3.5},
		map[string]any{"type": []byte("BlockStored")}, // a non-str tag: unknown, skipped
	}, 0})
	if err != nil {
		t.Fatal(err)
	}
	evs, err := Decode(payload)
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 2 || evs[0].Kind != BlockRemoved || evs[1].Kind != ItemStored || evs[1].Item != "h" {
		t.Fatalf("decoded %+v", evs)
	}
	want := []string{"\xff\xff\xff\xff\xff\xff\xff\xff", "\x80\x00\x00\x00\x00\x00\x00\x00", "digest"}
	for i, k := range want {
		if evs[0].Blocks[i] != k {
			t.Errorf("block %d = %q, want %q", i, evs[0].Blocks[i], k)
		}
	}
}

// reencode writes events back as a batch the way the engine would (for the fuzz round trip).
func reencode(t *testing.T, evs []Event) []byte {
	names := map[Kind]string{BlockStored: "BlockStored", BlockRemoved: "BlockRemoved",
		AllBlocksCleared: "AllBlocksCleared", EpochStarted: "EpochStarted",
		ItemStored: "MMItemStored", ItemEvicted: "MMItemEvicted"}
	out := make([]any, 0, len(evs))
	for _, ev := range evs {
		m := map[string]any{"type": names[ev.Kind]}
		switch ev.Kind {
		case BlockStored, BlockRemoved:
			hashes := make([][]byte, len(ev.Blocks))
			for i, b := range ev.Blocks {
				hashes[i] = []byte(b)
			}
			m["block_hashes"] = hashes
		case EpochStarted:
			m["epoch"] = ev.Epoch
		case ItemStored, ItemEvicted:
			m["mm_hash"] = ev.Item
		}
		out = append(out, m)
	}
	b, err := msgpack.Marshal([]any{0.0, out})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// FuzzDecode: any bytes decode to events or an error, never a panic, a stack overflow or an
// allocation the payload's size does not bound; what decodes survives a round trip.
// Seeds: testdata/fuzz/FuzzDecode (the golden batches and the inputs that crashed the old
// decoder) and hostile().
func FuzzDecode(f *testing.F) {
	for _, name := range []string{"kv_batch.msgpack", "mm_batch.msgpack"} {
		b, err := os.ReadFile("testdata/" + name)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	for _, payload := range hostile() {
		f.Add(payload)
	}
	f.Fuzz(func(t *testing.T, payload []byte) {
		evs, err := Decode(payload)
		if err != nil {
			var malformed *MalformedError
			if !errors.As(err, &malformed) {
				t.Fatalf("error %v is not a *MalformedError", err)
			}
			return
		}
		blocks := 0
		for _, ev := range evs {
			blocks += len(ev.Blocks)
		}
		if len(evs) > MaxEvents || blocks > MaxBlockHashes || len(evs) > len(payload) {
			t.Fatalf("%d events, %d blocks from %d bytes", len(evs), blocks, len(payload))
		}
		again, err := Decode(reencode(t, evs))
		if err != nil || !reflect.DeepEqual(normal(again), normal(evs)) {
			t.Fatalf("round trip: %+v -> %+v, %v", evs, again, err)
		}
	})
}

// normal makes empty and nil block lists equal (the round trip cannot tell them apart).
func normal(evs []Event) []Event {
	out := make([]Event, len(evs))
	for i, ev := range evs {
		if len(ev.Blocks) == 0 {
			ev.Blocks = nil
		}
		out[i] = ev
	}
	return out
}
