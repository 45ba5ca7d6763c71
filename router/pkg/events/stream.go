package events

import (
	"context"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-zeromq/zmq4"
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
type Stream struct {
	Pub, Replay string        // tcp://host:port of the PUB and ROUTER sockets
	Apply       func([]Event) // applies one batch to this stream's half of the index
	Clear       func()        // empties this stream's half of the index
	Probe       time.Duration // quiet time before a probe (default 1 s)
	Silence     time.Duration // unreachable time before the half is cleared (default 10 s)
	Timeout     time.Duration // one replay's budget (default 1 s)
	Log         logr.Logger

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
}

// Run follows the stream until ctx ends.
func (s *Stream) Run(ctx context.Context) {
	s.defaults()
	s.alive.Store(time.Now().UnixNano())
	for ctx.Err() == nil {
		s.follow(ctx)
	}
}

// follow runs one live subscription until the stream must be re-subscribed or ctx ends.
func (s *Stream) follow(ctx context.Context) {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	live := make(chan frame, 1024)
	go s.subscribe(sctx, live)
	s.resync(ctx) // catch up with what was published before the subscription
	quiet := time.NewTimer(s.Probe)
	defer quiet.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case f := <-live:
			s.onLive(ctx, f)
			quiet.Reset(s.Probe)
		case <-quiet.C:
			if s.resync(ctx) > 0 {
				// the replay had batches the subscription never delivered: re-subscribe
				s.Log.V(1).Info("live events lag the replay socket; re-subscribing", "pub", s.Pub)
				return
			}
			quiet.Reset(s.Probe)
		}
	}
}

func (s *Stream) subscribe(ctx context.Context, out chan<- frame) {
	sub := zmq4.NewSub(ctx, zmq4.WithDialerRetry(250*time.Millisecond), zmq4.WithDialerMaxRetries(-1))
	defer sub.Close()
	if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		s.Log.Error(err, "cannot subscribe", "pub", s.Pub)
		return
	}
	if err := sub.Dial(s.Pub); err != nil {
		return // ctx ended while dialling
	}
	for {
		msg, err := sub.Recv()
		if err != nil {
			return
		}
		if len(msg.Frames) != 3 || len(msg.Frames[1]) != 8 {
			continue // not a (topic, seq, payload) batch
		}
		select {
		case out <- frame{binary.BigEndian.Uint64(msg.Frames[1]), msg.Frames[2]}:
		case <-ctx.Done():
			return
		}
	}
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

// replay asks the ROUTER for every buffered batch with seq >= from, until the end marker.
func (s *Stream) replay(ctx context.Context, from uint64) ([]frame, error) {
	rctx, cancel := context.WithTimeout(ctx, s.Timeout)
	defer cancel()
	dealer := zmq4.NewDealer(rctx, zmq4.WithDialerMaxRetries(0))
	defer dealer.Close()
	if err := dealer.Dial(bounded(s.Replay)); err != nil { // handshake bounded by rctx too
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
	}
	done := make(chan result, 1)
	go func() {
		var frames []frame
		for {
			msg, err := dealer.Recv()
			if err != nil {
				done <- result{nil, err}
				return
			}
			if len(msg.Frames) != 4 || len(msg.Frames[2]) != 8 {
				done <- result{nil, fmt.Errorf("replay answered %d frames, want 4", len(msg.Frames))}
				return
			}
			if string(msg.Frames[2]) == string(endSeq) {
				done <- result{frames, nil}
				return
			}
			frames = append(frames, frame{binary.BigEndian.Uint64(msg.Frames[2]), msg.Frames[3]})
		}
	}()
	select {
	case r := <-done:
		return r.frames, r.err
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
