// Package eventstest stands in for an mmis engine's event sockets in Go tests: a
// well-behaved one (Engine: a PUB and a replay ROUTER speaking what
// server/mmis/engine/event_publisher.py speaks) and a hostile one (Raw: any bytes after a
// valid ZMTP handshake).
package eventstest

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"
)

// EndSeq is the replay's end marker.
var EndSeq = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// Engine publishes batches as server/mmis/engine/event_publisher.py does: PUB frames
// (topic, seq, payload) and a ROUTER answering (b"", start) with every buffered batch from
// start on, then the end marker. One engine life; Stop ends it.
type Engine struct {
	Pub, Replay string // tcp://host:port
	pub, router zmq4.Socket
	cancel      context.CancelFunc
	publish     chan []byte
	batches     [][]byte // owned by the serving goroutine
}

// FreePort is a TCP port free on host now.
func FreePort(t testing.TB, host string) int {
	t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// Start serves an engine's two sockets on host:pubPort and host:replayPort.
func Start(t testing.TB, host string, pubPort, replayPort int) *Engine {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	e := &Engine{
		Pub:    fmt.Sprintf("tcp://%s", net.JoinHostPort(host, fmt.Sprint(pubPort))),
		Replay: fmt.Sprintf("tcp://%s", net.JoinHostPort(host, fmt.Sprint(replayPort))),
		pub:    zmq4.NewPub(ctx), router: zmq4.NewRouter(ctx), cancel: cancel,
		publish: make(chan []byte),
	}
	if err := e.pub.Listen(e.Pub); err != nil {
		t.Fatal(err)
	}
	if err := e.router.Listen(e.Replay); err != nil {
		t.Fatal(err)
	}
	requests := make(chan zmq4.Msg)
	go func() {
		for {
			msg, err := e.router.Recv()
			if err != nil {
				return
			}
			select {
			case requests <- msg:
			case <-ctx.Done():
				return
			}
		}
	}()
	go func() { // one goroutine owns the buffer and both sockets' sends
		for {
			select {
			case <-ctx.Done():
				return
			case payload := <-e.publish:
				seq := binary.BigEndian.AppendUint64(nil, uint64(len(e.batches)))
				e.batches = append(e.batches, payload)
				_ = e.pub.Send(zmq4.NewMsgFrom([]byte{}, seq, payload))
			case msg := <-requests:
				if len(msg.Frames) != 3 || len(msg.Frames[2]) != 8 {
					continue
				}
				id, start := msg.Frames[0], binary.BigEndian.Uint64(msg.Frames[2])
				for i := start; i < uint64(len(e.batches)); i++ {
					seq := binary.BigEndian.AppendUint64(nil, i)
					_ = e.router.Send(zmq4.NewMsgFrom(id, []byte{}, []byte{}, seq, e.batches[i]))
				}
				_ = e.router.Send(zmq4.NewMsgFrom(id, []byte{}, []byte{}, EndSeq, []byte{}))
			}
		}
	}()
	t.Cleanup(e.Stop)
	return e
}

// Publish sends one batch (and keeps it for replays).
func (e *Engine) Publish(payload []byte) { e.publish <- payload }

// Stop closes both sockets (the engine's life ends; a new Start on the same ports is a
// restart). Stopping twice is harmless.
func (e *Engine) Stop() {
	e.cancel()
	e.pub.Close()
	e.router.Close()
}

// Batch is a msgpack batch [ts, events].
func Batch(t testing.TB, events ...map[string]any) []byte {
	t.Helper()
	b, err := msgpack.Marshal([]any{1.0, events})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// Stored is a BlockStored event of the given keys (as digest bytes).
func Stored(keys ...string) map[string]any {
	hashes := make([][]byte, len(keys))
	for i, k := range keys {
		hashes[i] = []byte(k)
	}
	return map[string]any{"type": "BlockStored", "block_hashes": hashes}
}

// ItemStored is an MMItemStored event.
func ItemStored(hash string) map[string]any {
	return map[string]any{"type": "MMItemStored", "mm_hash": hash, "nbytes": 1}
}

// Cleared is the KV stream's opening event; Epoch the multimodal stream's.
var Cleared = map[string]any{"type": "AllBlocksCleared"}

// Epoch is an EpochStarted event.
func Epoch(epoch string) map[string]any {
	return map[string]any{"type": "EpochStarted", "epoch": epoch}
}

// Greeting is a ZMTP 3.0 NULL greeting, as a server.
func Greeting() []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10], g[11] = 0xff, 0x7f, 3, 0
	copy(g[12:32], "NULL")
	g[32] = 1
	return g
}

// Ready is a NULL handshake's READY command naming the socket type.
func Ready(sockType string) []byte {
	body := append([]byte{5}, "READY"...)
	body = append(body, byte(len("Socket-Type")))
	body = append(body, "Socket-Type"...)
	body = binary.BigEndian.AppendUint32(body, uint32(len(sockType)))
	body = append(body, sockType...)
	return append([]byte{0x04, byte(len(body))}, body...)
}

// Frame is one ZMTP frame (short or long as its size needs).
func Frame(more bool, body []byte) []byte {
	flags := byte(0)
	if more {
		flags |= 0x01
	}
	if len(body) > 255 {
		return append(binary.BigEndian.AppendUint64([]byte{flags | 0x02}, uint64(len(body))), body...)
	}
	return append([]byte{flags, byte(len(body))}, body...)
}

// Message is a multipart message's frames.
func Message(frames ...[]byte) []byte {
	var out []byte
	for i, f := range frames {
		out = append(out, Frame(i < len(frames)-1, f)...)
	}
	return out
}

// HugeFrame is a frame header claiming 2^40 bytes.
var HugeFrame = []byte{0x02, 0, 0, 1, 0, 0, 0, 0, 0}

// RawPeer is a listener that says the same to every connection (Raw).
type RawPeer struct {
	Addr  string       // tcp://host:port
	Conns atomic.Int64 // connections accepted so far
}

// Raw listens on host:port (0: any) and says, to every connection, a NULL greeting,
// READY(sockType), then each of says in turn (one per connection, the last one repeated),
// holding the connection open for hold; what the client sends is read and dropped.
func Raw(t testing.TB, host string, port int, sockType string, hold time.Duration, says ...[]byte) *RawPeer {
	t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(host, fmt.Sprint(port)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	peer := &RawPeer{Addr: "tcp://" + l.Addr().String()}
	go func() {
		for n := 0; ; n++ {
			c, err := l.Accept()
			if err != nil {
				return
			}
			peer.Conns.Add(1)
			after := says[min(n, len(says)-1)]
			go func() { _, _ = io.Copy(io.Discard, c) }()
			go func() {
				defer c.Close()
				_, _ = c.Write(append(append(Greeting(), Ready(sockType)...), after...))
				time.Sleep(hold)
			}()
		}
	}()
	return peer
}
