package events

import (
	"sync"
)

// Index is what one engine holds, as its two event streams told it: the prefix cache's block
// keys and the multimodal cache's mm_hashes.
//
// Invariants:
//   - The KV half changes only through ApplyKV / ClearKV and the multimodal half only through
//     ApplyMM / ClearMM: each stream's subscriber owns its half, and a lost stream empties
//     only its own half (its data can no longer be trusted; the other's still can).
//   - Readers (the scorer, on the request path) never wait for a writer longer than one
//     batch's application.
type Index struct {
	mu     sync.RWMutex
	blocks map[string]struct{}
	items  map[string]struct{}
	epoch  string
}

// NewIndex returns an empty index.
func NewIndex() *Index {
	return &Index{blocks: map[string]struct{}{}, items: map[string]struct{}{}}
}

// ApplyKV applies one KV batch's events in order.
func (x *Index) ApplyKV(evs []Event) {
	x.mu.Lock()
	defer x.mu.Unlock()
	for _, ev := range evs {
		switch ev.Kind {
		case BlockStored:
			for _, k := range ev.Blocks {
				x.blocks[k] = struct{}{}
			}
		case BlockRemoved:
			for _, k := range ev.Blocks {
				delete(x.blocks, k)
			}
		case AllBlocksCleared:
			clear(x.blocks)
		}
	}
}

// ApplyMM applies one multimodal batch's events in order.
func (x *Index) ApplyMM(evs []Event) {
	x.mu.Lock()
	defer x.mu.Unlock()
	for _, ev := range evs {
		switch ev.Kind {
		case ItemStored:
			x.items[ev.Item] = struct{}{}
		case ItemEvicted:
			delete(x.items, ev.Item)
		case EpochStarted:
			clear(x.items)
			x.epoch = ev.Epoch
		}
	}
}

// ClearKV forgets every block (the KV stream was lost or restarted).
func (x *Index) ClearKV() {
	x.mu.Lock()
	defer x.mu.Unlock()
	clear(x.blocks)
}

// ClearMM forgets every item (the multimodal stream was lost or restarted).
func (x *Index) ClearMM() {
	x.mu.Lock()
	defer x.mu.Unlock()
	clear(x.items)
	x.epoch = ""
}

// Prefix is how many of keys, from the first, the index holds without a gap.
func (x *Index) Prefix(keys []string) int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	for i, k := range keys {
		if _, ok := x.blocks[k]; !ok {
			return i
		}
	}
	return len(keys)
}

// Items is how many of hashes the index holds.
func (x *Index) Items(hashes []string) int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	n := 0
	for _, h := range hashes {
		if _, ok := x.items[h]; ok {
			n++
		}
	}
	return n
}

// Sizes returns the number of blocks and items held, and the epoch (for logs and tests).
func (x *Index) Sizes() (blocks, items int, epoch string) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return len(x.blocks), len(x.items), x.epoch
}
