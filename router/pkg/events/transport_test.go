package events

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"

	"mmis.dev/router/pkg/events/eventstest"
)

var (
	greeting  = eventstest.Greeting
	ready     = eventstest.Ready
	zframe    = eventstest.Frame
	message   = eventstest.Message
	hugeFrame = eventstest.HugeFrame
)

func TestCappedConnPassesAWellFormedStream(t *testing.T) {
	stream := append(greeting(), ready("ROUTER")...)
	stream = append(stream, message([]byte{}, []byte("kv"), make([]byte, 8), bytes.Repeat([]byte{7}, 300))...)
	stream = append(stream, zframe(false, make([]byte, MaxFrameBytes))...) // exactly the cap
	for _, chunk := range []int{1, 7, 64, 4096, len(stream)} {
		c := newCappedConn(nil, nil)
		for b := stream; len(b) > 0; {
			k := min(chunk, len(b))
			if err := c.scan(b[:k]); err != nil {
				t.Fatalf("chunks of %d: %v", chunk, err)
			}
			b = b[k:]
		}
	}
}

func TestCappedConnRefusesWhatGoZeromqWouldAllocate(t *testing.T) {
	head := append(greeting(), ready("ROUTER")...)
	many := bytes.Repeat(zframe(true, []byte{1}), MaxMessageFrames+1)
	var big []byte
	for range MaxMessageBytes/MaxFrameBytes + 1 {
		big = append(big, binary.BigEndian.AppendUint64([]byte{flagMore | flagLong}, MaxFrameBytes)...)
		big = append(big, make([]byte, MaxFrameBytes)...)
	}
	for name, tail := range map[string][]byte{
		"a frame claiming 2^40 bytes":   hugeFrame,
		"a frame one byte over the cap": binary.BigEndian.AppendUint64([]byte{flagLong}, MaxFrameBytes+1),
		"a message of endless frames":   many,
		"a message over its byte cap":   big,
		"reserved flag bits":            {0x80, 0},
	} {
		c := newCappedConn(nil, nil)
		err := c.scan(append(append([]byte{}, head...), tail...))
		var fe *FrameError
		if !errors.As(err, &fe) {
			t.Errorf("%s: scan = %v, want a *FrameError", name, err)
		}
	}
	if err := newCappedConn(nil, nil).scan([]byte("GET / HTTP/1.1\r\n")); err == nil {
		t.Error("a stream that is not ZMTP was read")
	}
}

// A replay socket whose answer claims a 1 TiB frame: the replay fails at once, the picker's
// heap does not grow (go-zeromq alone would make([]byte, 1<<40): a fatal out-of-memory).
func TestAFrameClaimingATebibyteFailsTheReplayNotTheProcess(t *testing.T) {
	replay := eventstest.Raw(t, "127.0.0.1", 0, "ROUTER", 5*time.Second, hugeFrame).Addr
	s := &Stream{Replay: replay, Timeout: 2 * time.Second, Log: logr.Discard()}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, err := s.replay(context.Background(), 0)
	runtime.ReadMemStats(&after)
	var fe *FrameError
	if !errors.As(err, &fe) {
		t.Fatalf("replay = %v, want a *FrameError", err)
	}
	if grew := after.TotalAlloc - before.TotalAlloc; grew > 1<<20 {
		t.Errorf("the replay allocated %d bytes", grew)
	}
}

// A quiet engine is not a dead one: a subscription's handshake deadline ends with the
// handshake, so a batch published long after it still arrives live (no probe runs here).
func TestAQuietSubscriptionOutlivesItsHandshakeDeadline(t *testing.T) {
	engine := startEngine(t, freePort(t), freePort(t))
	engine.Publish(batch(t, cleared, stored("early")))
	idx := NewIndex()
	s := kvStream(engine, idx)
	s.Probe, s.Silence = time.Minute, time.Minute
	s.Timeout = 100 * time.Millisecond // the handshake budget: 500 ms
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go s.Run(ctx)
	eventually(t, "the first batch, from the replay", func() bool { return idx.Prefix([]string{"early"}) == 1 })
	time.Sleep(1500 * time.Millisecond) // three handshake budgets of silence
	engine.Publish(batch(t, stored("late")))
	deadline := time.Now().Add(3 * time.Second)
	for idx.Prefix([]string{"late"}) != 1 {
		if time.Now().After(deadline) {
			t.Fatal("a batch published after a quiet spell never arrived live")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A READY naming a socket type go-zeromq does not know made it panic in the handshake
// (FuzzStream found it): a refused connection now, not a panic, on both sockets.
func TestAnUnknownSocketTypeIsARefusedHandshake(t *testing.T) {
	bogus := eventstest.Raw(t, "127.0.0.1", 0, "BOGUS", time.Second, []byte{}).Addr
	s := &Stream{Pub: bogus, Replay: bogus, Apply: func([]Event) {}, Clear: func() {},
		Probe: 50 * time.Millisecond, Timeout: time.Second, Log: logr.Discard()}
	_, err := s.replay(context.Background(), 0)
	var he *HandshakeError
	if !errors.As(err, &he) {
		t.Fatalf("replay = %v, want a *HandshakeError", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	s.Run(ctx) // subscriptions and replays, a few times over
	if n := s.panics.Load(); n != 0 {
		t.Errorf("%d panics reached the stream", n)
	}
}

// FuzzStream: any bytes an engine's socket sends (after a valid handshake, or from the
// greeting on when the input starts with 0xff, as a greeting does) reach go-zeromq only
// through the frame-capping connection, and what go-zeromq makes of them goes through the
// stream's own parsing (replayFrame, liveFrame), Decode and an index, as in Stream: no panic,
// no allocation beyond the caps, whatever the bytes. Seeds: testdata/fuzz/FuzzStream and
// those below (the frames and payloads that crashed the picker among them).
func FuzzStream(f *testing.F) {
	golden := func(name string) []byte {
		b, err := os.ReadFile(filepath.Join("testdata", name))
		if err != nil {
			f.Fatal(err)
		}
		return b
	}
	seq := func(n uint64) []byte { return binary.BigEndian.AppendUint64(nil, n) }
	f.Add(message([]byte{}, []byte("kv"), seq(0), golden("kv_batch.msgpack")))
	f.Add(append(message([]byte{}, []byte("mm"), seq(0), golden("mm_batch.msgpack")),
		message([]byte{}, []byte{}, endSeq, []byte{})...))
	f.Add(message([]byte("kv"), seq(3), golden("kv_batch.msgpack")))
	f.Add(message([]byte{}, []byte("kv"), seq(1), []byte{0xdd, 0x04, 0x00, 0x00, 0x00}))
	f.Add(message([]byte{}, []byte("kv"), seq(2), bytes.Repeat([]byte{0x91}, 1<<16)))
	f.Add(hugeFrame)
	f.Add(bytes.Repeat(zframe(true, []byte{1}), 64))
	f.Add(append([]byte{flagCommand, 5, 4}, "PING"...))
	f.Add(append(greeting(), ready("ROUTER")...))                           // a whole stream
	f.Add(append(greeting(), flagCommand|flagLong, 0, 0, 1, 0, 0, 0, 0, 0)) // a huge READY
	f.Fuzz(func(t *testing.T, data []byte) {
		client, server := net.Pipe()
		defer client.Close()
		go func() { _, _ = io.Copy(io.Discard, server) }()
		stream := data // an input starting as a greeting does (0xff) is the whole stream
		if len(data) == 0 || data[0] != 0xff {
			stream = append(append(greeting(), ready("ROUTER")...), data...)
		}
		go func() {
			_, _ = server.Write(stream)
			server.Close()
		}()
		var conn *zmq4.Conn
		err := handshake(func() (err error) {
			conn, err = zmq4.Open(newCappedConn(client, nil), null.Security(), zmq4.Dealer,
				zmq4.SocketIdentity("fuzz"), false, nil)
			return err
		})
		if err != nil {
			return
		}
		idx := NewIndex()
		for range len(data) + 1 { // every message takes at least one byte
			msg, err := conn.RecvMsg()
			if err != nil {
				return
			}
			if f, ok := liveFrame(msg); ok {
				if evs, err := Decode(f.payload); err == nil {
					idx.ApplyKV(evs)
				}
			}
			if f, end, err := replayFrame(msg); err == nil && !end {
				if evs, err := Decode(f.payload); err == nil {
					idx.ApplyMM(evs)
				}
			}
		}
	})
}
