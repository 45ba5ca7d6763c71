package events

import (
	"context"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"runtime/debug"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-zeromq/zmq4"
	"golang.org/x/sync/semaphore"
)

var endSeq = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// Stream follows one event stream of one engine (server/mmis/engine/event_publisher.py):
// live batches from its PUB socket, and replays from its ROUTER socket.
//
// Invariants:
//   - Batches are applied once each, in sequence order. A gap (a live seq past the next one
//     expected) is filled from the replay socket before anything later is applied.
//   - The engine's identity is checked through the replay socket: every probe asks for the
//     last batch applied and expects the same bytes back. Anything else (an engine restarted,
//     with sequence numbers from 0 again, or a buffer that no longer reaches back) clears this
//     stream's half of the index and rebuilds it from a replay from 0.
//   - The engine is alive while live batches arrive or its replay socket answers. A stream
//     that cannot be reached for Silence (no live batch and no replay answer, or a malformed
//     batch) clears its half of the index: a pod is then scored as holding nothing, so a request is
//     routed by load alone and never fails for lack of cache data.
//   - When quiet for Probe, the replay socket is asked for anything newer (a probe): a lost
//     live subscription costs latency of at most Probe, never correctness.
//   - Hostile bytes cost bounded memory (docs/SECURITY.md): frames are capped on the
//     connection (transport.go), batches are decoded with bounds (Decode), live batches
//     waiting to be applied hold at most LiveBudget bytes, and one replay at most
//     ReplayBudget bytes (a longer one is applied in parts: the next probe goes on from the
//     last batch applied).
//   - A panic in any of the stream's goroutines (Run's, the subscription's, a replay's reader)
//     is recovered: the stream's half is cleared and distrusted (the pod scored by load), the
//     panic logged with its stack, and the stream followed again after Backoff (doubling, at
//     most MaxBackoff, while it keeps panicking). It never ends the process.
type Stream struct {
	Pub, Replay string        // tcp://host:port of the PUB and ROUTER sockets
	Token       string        // the internal token: PLAIN credentials (user PlainUser); "": NULL
	Apply       func([]Event) // applies one batch to this stream's half of the index
	Clear       func()        // empties this stream's half of the index
	Probe       time.Duration // quiet time before a probe (default 1 s)
	Silence     time.Duration // unreachable time before the half is cleared (default 10 s)
	Timeout     time.Duration // one replay's budget (default 1 s)
	Backoff     time.Duration // wait after a panic before following again (default 1 s)
	Log         logr.Logger

	// test hooks: called with every message read (live, replay) before it is used
	onLiveMsg, onReplayMsg func(zmq4.Msg)
	panics                 atomic.Int64 // panics recovered (tests)

	// owned by Run's goroutine (live batches and probes are handled one at a time there)
	next       uint64 // the next live seq expected, valid when have
	have       bool   // a batch was applied since the last clear
	lastSeq    uint64
	lastDigest uint64
	// read by Live from the request path
	alive   atomic.Int64 // unix nanoseconds of the engine's last answer; 0: none trusted
	cleared atomic.Bool  // the half was cleared for silence and not rebuilt since
}

type frame struct {
	seq     uint64
	payload []byte
}

const (
	// LiveBudget bounds the bytes of live batches received and not yet applied.
	LiveBudget = 4 * MaxMessageBytes
	// ReplayBudget bounds the bytes one replay holds; ReplayFrames its batches.
	ReplayBudget = 8 * MaxMessageBytes
	ReplayFrames = 1 << 16
	// MaxBackoff bounds the wait after repeated panics.
	MaxBackoff = 30 * time.Second
)

// streamPanic is a panic recovered in one of a stream's goroutines, carried to Run's.
type streamPanic struct {
	value any
	stack []byte
}

func recovered(v any) *streamPanic {
	if p, ok := v.(*streamPanic); ok {
		return p
	}
	return &streamPanic{v, debug.Stack()}
}

func (s *Stream) defaults() {
	if s.Probe <= 0 {
		s.Probe = time.Second
	}
	if s.Silence <= 0 {
		s.Silence = 10 * time.Second
	}
	if s.Timeout <= 0 {
		s.Timeout = time.Second
	}
	if s.Backoff <= 0 {
		s.Backoff = time.Second
	}
}

// Run follows the stream until ctx ends; it never panics (see the invariants).
func (s *Stream) Run(ctx context.Context) {
	s.defaults()
	s.alive.Store(time.Now().UnixNano())
	wait := s.Backoff
	for ctx.Err() == nil {
		started := time.Now()
		if s.followSafely(ctx) {
			continue
		}
		if time.Since(started) > MaxBackoff { // it ran well for a while: start over
			wait = s.Backoff
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		wait = min(2*wait, MaxBackoff)
	}
}

// followSafely runs follow, and reports false after recovering a panic from it.
func (s *Stream) followSafely(ctx context.Context) (ok bool) {
	defer func() {
		if v := recover(); v != nil {
			ok = false
			s.crashed(recovered(v))
		}
	}()
	s.follow(ctx)
	return true
}

// crashed forgets and distrusts the stream after a panic.
func (s *Stream) crashed(p *streamPanic) {
	s.panics.Add(1)
	s.alive.Store(0) // scored as holding nothing until a replay answers again
	s.Log.Error(fmt.Errorf("panic: %v", p.value), "a panic while following the engine's events; "+
		"its pod is scored by load until the stream is followed again",
		"pub", s.Pub, "replay", s.Replay, "stack", string(p.stack))
	func() {
		defer func() {
			if v := recover(); v != nil {
				s.Log.Error(fmt.Errorf("panic: %v", v), "clearing the stream's index panicked too", "pub", s.Pub)
			}
		}()
		s.reset()
	}()
}

// follow runs one live subscription until the stream must be re-subscribed or ctx ends: the
// replay had batches the subscription never delivered, or the subscription ended (its
// connection closed or refused); either way at a probe, so at most once per Probe.
func (s *Stream) follow(ctx context.Context) {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	live := make(chan frame, 1024)
	budget := semaphore.NewWeighted(LiveBudget)
	crashed := make(chan *streamPanic, 1)
	ended := make(chan struct{})
	go func() {
		defer close(ended) // after the panic, if any, is in crashed
		defer func() {
			if v := recover(); v != nil {
				crashed <- recovered(v)
			}
		}()
		s.subscribe(sctx, live, budget)
	}()
	s.resync(ctx) // catch up with what was published before the subscription
	quiet := time.NewTimer(s.Probe)
	defer quiet.Stop()
	subscribed, lost := (<-chan struct{})(ended), false
	for {
		select {
		case <-ctx.Done():
			return
		case p := <-crashed:
			panic(p) // recovered by followSafely, in this goroutine
		case <-subscribed:
			select {
			case p := <-crashed:
				panic(p)
			default:
			}
			subscribed, lost = nil, true
		case f := <-live:
			budget.Release(int64(len(f.payload)))
			s.onLive(ctx, f)
			quiet.Reset(s.Probe)
		case <-quiet.C:
			if s.resync(ctx) > 0 {
				s.Log.V(1).Info("live events lag the replay socket; re-subscribing", "pub", s.Pub)
				return
			}
			if lost {
				s.Log.V(1).Info("the subscription ended; subscribing again", "pub", s.Pub)
				return
			}
			quiet.Reset(s.Probe)
		}
	}
}

// options are a socket's options: the mechanism (security) and the dialling behaviour.
func (s *Stream) options(opts ...zmq4.Option) []zmq4.Option {
	if sec := security(s.Token); sec != nil {
		opts = append(opts, zmq4.WithSecurity(sec))
	}
	return append(opts, zmq4.WithDialerTimeout(s.Timeout))
}

// subscribe reads live batches until ctx ends or the subscription fails. A batch waits in
// out only while budget has room for it (LiveBudget); the reader releases it.
func (s *Stream) subscribe(ctx context.Context, out chan<- frame, budget *semaphore.Weighted) {
	hctx := context.WithValue(ctx, handshakeKey{}, 5*s.Timeout)
	sub := zmq4.NewSub(hctx, s.options(zmq4.WithDialerRetry(250*time.Millisecond), zmq4.WithDialerMaxRetries(-1))...)
	defer sub.Close()
	if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		s.Log.Error(err, "cannot subscribe", "pub", s.Pub)
		return
	}
	if err := handshake(func() error { return sub.Dial(subscription(s.Pub)) }); err != nil {
		if ctx.Err() == nil {
			s.Log.Info("cannot subscribe to the engine's events (a wrong MMIS_INTERNAL_TOKEN?); "+
				"following its replay socket", "pub", s.Pub, "err", err.Error())
		}
		return
	}
	for {
		msg, err := sub.Recv()
		if err != nil {
			if ctx.Err() == nil {
				s.Log.V(1).Info("subscription ended", "pub", s.Pub, "err", err.Error())
			}
			return
		}
		if s.onLiveMsg != nil {
			s.onLiveMsg(msg)
		}
		f, ok := liveFrame(msg)
		if !ok {
			continue // not a (topic, seq, payload) batch
		}
		if err := budget.Acquire(ctx, int64(len(f.payload))); err != nil {
			return
		}
		select {
		case out <- f:
		case <-ctx.Done():
			return
		}
	}
}

// liveFrame is a PUB message's batch: (topic, seq, payload).
func liveFrame(msg zmq4.Msg) (frame, bool) {
	if len(msg.Frames) != 3 || len(msg.Frames[1]) != 8 || len(msg.Frames[2]) > MaxBatchBytes {
		return frame{}, false
	}
	return frame{binary.BigEndian.Uint64(msg.Frames[1]), msg.Frames[2]}, true
}

// replayFrame is one ROUTER answer: a batch, or the end marker (end).
func replayFrame(msg zmq4.Msg) (f frame, end bool, err error) {
	if len(msg.Frames) != 4 || len(msg.Frames[2]) != 8 {
		return frame{}, false, fmt.Errorf("replay answered %d frames, want 4", len(msg.Frames))
	}
	if string(msg.Frames[2]) == string(endSeq) {
		return frame{}, true, nil
	}
	return frame{binary.BigEndian.Uint64(msg.Frames[2]), msg.Frames[3]}, false, nil
}

func (s *Stream) onLive(ctx context.Context, f frame) {
	s.alive.Store(time.Now().UnixNano()) // a live batch is proof of life too
	switch {
	case !s.have || f.seq > s.next:
		s.resync(ctx) // first batch seen, or a gap: the replay has it and what came before
	case f.seq == s.next:
		s.apply(f)
	case f.seq == 0:
		// seq below the next expected: a duplicate of a replayed batch, unless a new engine
		// opens its life (seq 0, AllBlocksCleared / EpochStarted)
		if evs, err := Decode(f.payload); err == nil && StartsLife(evs) {
			s.Log.Info("engine restarted; its index starts over", "pub", s.Pub)
			s.reset()
			s.apply(f)
		}
	}
}

// resync asks the replay socket for everything from the last applied batch on, checks that
// it is the same engine, and applies what is new. It returns how many batches it applied.
func (s *Stream) resync(ctx context.Context) int {
	from := uint64(0)
	if s.have {
		from = s.lastSeq
	}
	frames, err := s.replay(ctx, from)
	if err != nil {
		s.silent(err)
		return 0
	}
	s.alive.Store(time.Now().UnixNano())
	if s.have {
		if len(frames) == 0 || frames[0].seq != s.lastSeq || digest(frames[0].payload) != s.lastDigest {
			s.Log.Info("engine no longer replays the last batch applied (restarted?); rebuilding",
				"replay", s.Replay)
			s.reset()
			if frames, err = s.replay(ctx, 0); err != nil {
				s.silent(err)
				return 0
			}
		} else {
			frames = frames[1:]
		}
	}
	applied := 0
	for _, f := range frames {
		if s.have && f.seq < s.next {
			continue
		}
		if !s.apply(f) {
			break
		}
		applied++
	}
	s.cleared.Store(false)
	return applied
}

func (s *Stream) apply(f frame) bool {
	evs, err := Decode(f.payload)
	if err != nil {
		s.Log.Error(err, "malformed batch; forgetting this engine's stream", "pub", s.Pub, "seq", f.seq)
		s.reset()
		s.alive.Store(0) // scored as empty until a replay answers with good batches
		return false
	}
	s.Apply(evs)
	s.have, s.next, s.lastSeq, s.lastDigest = true, f.seq+1, f.seq, digest(f.payload)
	return true
}

func (s *Stream) reset() {
	s.Clear()
	s.have, s.next = false, 0
}

func (s *Stream) silent(err error) {
	if !s.cleared.Load() && time.Since(time.Unix(0, s.alive.Load())) > s.Silence {
		s.Log.Info("engine's events silent; scoring it as empty", "replay", s.Replay, "err", err.Error())
		s.reset()
		s.cleared.Store(true)
	}
}

// replay asks the ROUTER for every buffered batch with seq >= from, until the end marker,
// or until the batches received reach ReplayBudget bytes or ReplayFrames batches: then the
// replay is abandoned and what came is returned (the next resync goes on from there).
func (s *Stream) replay(ctx context.Context, from uint64) ([]frame, error) {
	rctx, cancel := context.WithTimeout(ctx, s.Timeout)
	defer cancel()
	dealer := zmq4.NewDealer(rctx, s.options(zmq4.WithDialerMaxRetries(0))...)
	defer dealer.Close()
	// the handshake is bounded by rctx too
	if err := handshake(func() error { return dealer.Dial(bounded(s.Replay)) }); err != nil {
		return nil, err
	}
	req := make([]byte, 8)
	binary.BigEndian.PutUint64(req, from)
	if err := dealer.Send(zmq4.NewMsgFrom([]byte{}, req)); err != nil {
		return nil, err
	}
	type result struct {
		frames []frame
		err    error
		panic  *streamPanic
	}
	done := make(chan result, 1)
	go func() {
		defer func() {
			if v := recover(); v != nil {
				done <- result{panic: recovered(v)}
			}
		}()
		var frames []frame
		held := 0
		for {
			msg, err := dealer.Recv()
			if err != nil {
				done <- result{nil, err, nil}
				return
			}
			if s.onReplayMsg != nil {
				s.onReplayMsg(msg)
			}
			f, end, err := replayFrame(msg)
			if err != nil || end {
				done <- result{frames, err, nil}
				return
			}
			frames = append(frames, f)
			held += len(f.payload)
			if held >= ReplayBudget || len(frames) >= ReplayFrames {
				s.Log.V(1).Info("a long replay: applying it in parts", "replay", s.Replay, "batches", len(frames))
				done <- result{frames, nil, nil}
				return
			}
		}
	}()
	select {
	case r := <-done:
		if r.panic != nil {
			panic(r.panic) // recovered by followSafely, in Run's goroutine
		}
		if r.err != nil {
			return nil, r.err
		}
		return r.frames, nil
	case <-rctx.Done():
		dealer.Close() // unblocks the reader
		return nil, fmt.Errorf("replay from %d: no answer within %s", from, s.Timeout)
	}
}

// Live reports whether the engine answered within Silence (the scorer's trust in this half).
func (s *Stream) Live() bool {
	at := s.alive.Load()
	return !s.cleared.Load() && at != 0 && time.Since(time.Unix(0, at)) <= s.Silence
}

func digest(b []byte) uint64 {
	h := fnv.New64a()
	_, _ = h.Write(b)
	return h.Sum64()
}
