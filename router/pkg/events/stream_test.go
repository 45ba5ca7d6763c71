package events

import (
	"context"
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-zeromq/zmq4"

	"mmis.dev/router/pkg/events/eventstest"
)

func freePort(t *testing.T) int { return eventstest.FreePort(t, "127.0.0.1") }

func startEngine(t *testing.T, pubPort, replayPort int) *eventstest.Engine {
	return eventstest.Start(t, "127.0.0.1", pubPort, replayPort)
}

func batch(t *testing.T, events ...map[string]any) []byte { return eventstest.Batch(t, events...) }

func stored(hash string) map[string]any { return eventstest.Stored(hash) }

var cleared = eventstest.Cleared

func eventually(t *testing.T, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("not within 10 s: %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func kvStream(e *eventstest.Engine, idx *Index) *Stream {
	return &Stream{
		Pub: e.Pub, Replay: e.Replay, Apply: idx.ApplyKV, Clear: idx.ClearKV,
		Probe: 100 * time.Millisecond, Silence: 5 * time.Second, Timeout: 500 * time.Millisecond,
		Log: logr.Discard(),
	}
}

func TestAStreamFollowsAnEngineAcrossARestart(t *testing.T) {
	pubPort, replayPort := freePort(t), freePort(t)
	first := startEngine(t, pubPort, replayPort)
	first.Publish(batch(t, cleared))
	first.Publish(batch(t, stored("first-life")))

	idx := NewIndex()
	s := kvStream(first, idx)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go s.Run(ctx)
	// published before the stream started: read from the replay socket
	eventually(t, "the first life's block", func() bool { return idx.Prefix([]string{"first-life"}) == 1 })
	if !s.Live() {
		t.Error("a stream whose replay socket answers is trusted")
	}
	first.Publish(batch(t, stored("later")))
	eventually(t, "a block published later", func() bool { return idx.Prefix([]string{"later"}) == 1 })

	// the engine restarts on the same ports: sequence numbers from 0 again, a new life
	first.Stop()
	second := startEngine(t, pubPort, replayPort)
	second.Publish(batch(t, cleared))
	second.Publish(batch(t, stored("second-life")))
	eventually(t, "the second life's block, the first life forgotten", func() bool {
		return idx.Prefix([]string{"second-life"}) == 1 && idx.Prefix([]string{"first-life"}) == 0 &&
			idx.Prefix([]string{"later"}) == 0
	})
}

func TestABusyStreamStaysTrusted(t *testing.T) {
	// live batches keep coming faster than Probe: no probe runs, and the stream must still be
	// trusted after more than Silence (the batches themselves prove the engine alive)
	engine := startEngine(t, freePort(t), freePort(t))
	engine.Publish(batch(t, cleared))
	idx := NewIndex()
	s := kvStream(engine, idx)
	s.Probe, s.Silence = time.Second, 300*time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go s.Run(ctx)
	engine.Publish(batch(t, stored("b0")))
	eventually(t, "the first block", func() bool { return idx.Prefix([]string{"b0"}) == 1 })
	for i := 1; i <= 20; i++ { // 1 s of traffic, a batch every 50 ms
		time.Sleep(50 * time.Millisecond)
		engine.Publish(batch(t, stored(fmt.Sprintf("b%d", i))))
	}
	eventually(t, "the last block", func() bool { return idx.Prefix([]string{"b20"}) == 1 })
	if !s.Live() {
		t.Fatal("a stream whose batches keep arriving was distrusted")
	}
}

// A panic in any of a stream's goroutines is recovered: the stream's half is emptied and
// distrusted (its pod scored by load), and it is followed again after Backoff. The test
// process surviving is the first half of the check.
func TestAPanicDropsTheStreamNotTheProcess(t *testing.T) {
	for _, where := range []string{"Apply", "the subscription", "the replay reader"} {
		t.Run(where, func(t *testing.T) {
			engine := startEngine(t, freePort(t), freePort(t))
			engine.Publish(batch(t, cleared))
			engine.Publish(batch(t, stored("before")))
			idx := NewIndex()
			s := kvStream(engine, idx)
			s.Backoff = 1500 * time.Millisecond
			var armed atomic.Bool // panics once, at the first batch carrying "boom"
			boom := func() {
				if armed.CompareAndSwap(true, false) {
					panic("boom in " + where)
				}
			}
			switch where {
			case "Apply":
				s.Apply = func(evs []Event) {
					if len(evs) > 0 && len(evs[0].Blocks) > 0 && evs[0].Blocks[0] == "boom" {
						boom()
					}
					idx.ApplyKV(evs)
				}
			case "the subscription":
				s.Probe = time.Minute // "boom" reaches the stream live only
				s.onLiveMsg = func(zmq4.Msg) { boom() }
			case "the replay reader":
				s.onReplayMsg = func(zmq4.Msg) { boom() }
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			go s.Run(ctx)
			eventually(t, "the first block", func() bool { return idx.Prefix([]string{"before"}) == 1 && s.Live() })
			armed.Store(true)
			engine.Publish(batch(t, stored("boom")))
			eventually(t, "the panic recovered", func() bool { return s.panics.Load() == 1 })
			if s.Live() || idx.Prefix([]string{"before"}) != 0 {
				t.Errorf("after a panic the stream is trusted (%v) or its half kept (%d blocks)",
					s.Live(), idx.Prefix([]string{"before"}))
			}
			// followed again after the back-off: rebuilt from a replay from 0
			eventually(t, "followed again", func() bool {
				return s.Live() && idx.Prefix([]string{"before"}) == 1 && idx.Prefix([]string{"boom"}) == 1
			})
		})
	}
}

// A hostile engine next to a good one: frames claiming a tebibyte, batches claiming 67M
// elements, 2 MB of nesting and garbage cost the stream following it bounded memory and
// never its process, while the good engine's stream keeps applying.
func TestAHostileEngineCostsBoundedMemory(t *testing.T) {
	hostile := [][]byte{
		eventstest.HugeFrame,
		eventstest.Message([]byte{}, []byte{}, make([]byte, 8), []byte{0xdd, 0x04, 0x00, 0x00, 0x00}),
		eventstest.Message([]byte{}, []byte{}, make([]byte, 8), make([]byte, 2<<20)),
		eventstest.Message([]byte{}, []byte{}, make([]byte, 8), bytesOf(0x91, 2<<20)),
		[]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
	}
	pubHostile := make([][]byte, len(hostile))
	for i, h := range hostile { // PUB messages are (topic, seq, payload)
		pubHostile[i] = h
		if i == 1 || i == 2 || i == 3 {
			pubHostile[i] = eventstest.Message([]byte{}, make([]byte, 8), []byte{0xdd, 0x04, 0x00, 0x00, 0x00})
		}
	}
	bad := &Stream{
		Pub:    eventstest.Raw(t, "127.0.0.1", 0, "PUB", 200*time.Millisecond, pubHostile...).Addr,
		Replay: eventstest.Raw(t, "127.0.0.1", 0, "ROUTER", 200*time.Millisecond, hostile...).Addr,
		Apply:  func([]Event) {}, Clear: func() {}, Probe: 50 * time.Millisecond,
		Silence: 200 * time.Millisecond, Timeout: 300 * time.Millisecond, Log: logr.Discard(),
	}
	engine := startEngine(t, freePort(t), freePort(t))
	engine.Publish(batch(t, cleared))
	idx := NewIndex()
	good := kvStream(engine, idx)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go bad.Run(ctx)
	go good.Run(ctx)
	var peak uint64
	for i := range 40 { // 2 s of hostility: every connection gets the next hostile answer
		engine.Publish(batch(t, stored(fmt.Sprintf("g%d", i))))
		time.Sleep(50 * time.Millisecond)
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		peak = max(peak, m.HeapAlloc)
	}
	eventually(t, "the good engine's blocks", func() bool { return idx.Prefix([]string{"g39"}) == 1 })
	if bad.Live() {
		t.Error("a stream answering garbage is trusted")
	}
	if !good.Live() {
		t.Error("the good engine's stream is distrusted")
	}
	if peak > 256<<20 {
		t.Errorf("the picker's heap reached %d MiB", peak>>20)
	}
	t.Logf("peak heap %d MiB, panics %d", peak>>20, bad.panics.Load())
}

// A replay longer than ReplayBudget is read in parts, each bounded, and all of it applied.
func TestALongReplayIsHeldInBoundedParts(t *testing.T) {
	engine := startEngine(t, freePort(t), freePort(t))
	engine.Publish(batch(t, cleared))
	const n = ReplayBudget/(MaxBatchBytes-1024) + 3 // batches of almost MaxBatchBytes each
	for i := range n {
		digest := make([]byte, MaxBatchBytes-1024)
		copy(digest, fmt.Sprintf("big-%d", i))
		engine.Publish(batch(t, map[string]any{"type": "BlockStored", "block_hashes": [][]byte{digest}}))
	}
	idx := NewIndex()
	s := kvStream(engine, idx)
	s.Timeout = 10 * time.Second
	frames, err := s.replay(context.Background(), 0)
	if err != nil {
		t.Fatal(err)
	}
	held := 0
	for _, f := range frames {
		held += len(f.payload)
	}
	if held > ReplayBudget+MaxMessageBytes || len(frames) >= n+1 {
		t.Errorf("one replay held %d batches, %d bytes (budget %d)", len(frames), held, ReplayBudget)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go s.Run(ctx)
	eventually(t, "every batch applied", func() bool {
		b, _, _ := idx.Sizes()
		return b == n
	})
}

// A subscription that ends (its connection closed, or refused as here: every answer is
// garbage) is dialled again at the next probe, not only when a replay finds batches it missed.
func TestALostSubscriptionIsDialledAgain(t *testing.T) {
	engine := startEngine(t, freePort(t), freePort(t))
	engine.Publish(batch(t, cleared))
	pub := eventstest.Raw(t, "127.0.0.1", 0, "PUB", time.Second, eventstest.HugeFrame)
	idx := NewIndex()
	s := kvStream(engine, idx)
	s.Pub = pub.Addr
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go s.Run(ctx)
	eventually(t, "five subscriptions", func() bool { return pub.Conns.Load() >= 5 })
	if !s.Live() {
		t.Error("a stream whose replay answers is distrusted for its subscription's sake")
	}
}

func bytesOf(b byte, n int) []byte {
	out := make([]byte, n)
	for i := range out {
		out[i] = b
	}
	return out
}
