package events

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"
)

// fakeEngine publishes batches as server/mmis/engine/event_publisher.py does: PUB frames
// (topic, seq, payload) and a ROUTER answering (b"", start) with every buffered batch from
// start on, then the end marker. A unit-test stand-in for one engine life.
type fakeEngine struct {
	pub, router zmq4.Socket
	cancel      context.CancelFunc
	batches     [][]byte
	ready       chan struct{}
	publishCh   chan<- []byte
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func startEngine(t *testing.T, pubPort, replayPort int) *fakeEngine {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	e := &fakeEngine{pub: zmq4.NewPub(ctx), router: zmq4.NewRouter(ctx), cancel: cancel}
	if err := e.pub.Listen(fmt.Sprintf("tcp://127.0.0.1:%d", pubPort)); err != nil {
		t.Fatal(err)
	}
	if err := e.router.Listen(fmt.Sprintf("tcp://127.0.0.1:%d", replayPort)); err != nil {
		t.Fatal(err)
	}
	requests := make(chan zmq4.Msg)
	go func() {
		for {
			msg, err := e.router.Recv()
			if err != nil {
				return
			}
			requests <- msg
		}
	}()
	e.ready = make(chan struct{})
	publish := make(chan []byte)
	go func() { // one goroutine owns the buffer and both sockets' sends
		close(e.ready)
		for {
			select {
			case <-ctx.Done():
				return
			case payload := <-publish:
				seq := make([]byte, 8)
				binary.BigEndian.PutUint64(seq, uint64(len(e.batches)))
				e.batches = append(e.batches, payload)
				_ = e.pub.Send(zmq4.NewMsgFrom([]byte{}, seq, payload))
			case msg := <-requests:
				id, start := msg.Frames[0], binary.BigEndian.Uint64(msg.Frames[2])
				for i := start; i < uint64(len(e.batches)); i++ {
					seq := make([]byte, 8)
					binary.BigEndian.PutUint64(seq, i)
					_ = e.router.Send(zmq4.NewMsgFrom(id, []byte{}, []byte{}, seq, e.batches[i]))
				}
				_ = e.router.Send(zmq4.NewMsgFrom(id, []byte{}, []byte{}, endSeq, []byte{}))
			}
		}
	}()
	t.Cleanup(e.stop)
	e.publishCh = publish
	return e
}

func (e *fakeEngine) stop() {
	e.cancel()
	e.pub.Close()
	e.router.Close()
}

func batch(t *testing.T, events ...map[string]any) []byte {
	t.Helper()
	b, err := msgpack.Marshal([]any{1.0, events})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func stored(hash string) map[string]any {
	return map[string]any{"type": "BlockStored", "block_hashes": [][]byte{[]byte(hash)}}
}

var cleared = map[string]any{"type": "AllBlocksCleared"}

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

func TestAStreamFollowsAnEngineAcrossARestart(t *testing.T) {
	pubPort, replayPort := freePort(t), freePort(t)
	first := startEngine(t, pubPort, replayPort)
	first.publishCh <- batch(t, cleared)
	first.publishCh <- batch(t, stored("first-life"))

	idx := NewIndex()
	s := &Stream{
		Pub: fmt.Sprintf("tcp://127.0.0.1:%d", pubPort), Replay: fmt.Sprintf("tcp://127.0.0.1:%d", replayPort),
		Apply: idx.ApplyKV, Clear: idx.ClearKV, Probe: 100 * time.Millisecond, Silence: 5 * time.Second,
		Timeout: 500 * time.Millisecond, Log: logr.Discard(),
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go s.Run(ctx)
	// published before the stream started: read from the replay socket
	eventually(t, "the first life's block", func() bool { return idx.Prefix([]string{"first-life"}) == 1 })
	if !s.Live() {
		t.Error("a stream whose replay socket answers is trusted")
	}
	first.publishCh <- batch(t, stored("later"))
	eventually(t, "a block published later", func() bool { return idx.Prefix([]string{"later"}) == 1 })

	// the engine restarts on the same ports: sequence numbers from 0 again, a new life
	first.stop()
	second := startEngine(t, pubPort, replayPort)
	second.publishCh <- batch(t, cleared)
	second.publishCh <- batch(t, stored("second-life"))
	eventually(t, "the second life's block, the first life forgotten", func() bool {
		return idx.Prefix([]string{"second-life"}) == 1 && idx.Prefix([]string{"first-life"}) == 0 &&
			idx.Prefix([]string{"later"}) == 0
	})
}

func TestABusyStreamStaysTrusted(t *testing.T) {
	// live batches keep coming faster than Probe: no probe runs, and the stream must still be
	// trusted after more than Silence (the batches themselves prove the engine alive)
	pubPort, replayPort := freePort(t), freePort(t)
	engine := startEngine(t, pubPort, replayPort)
	engine.publishCh <- batch(t, cleared)
	idx := NewIndex()
	s := &Stream{
		Pub: fmt.Sprintf("tcp://127.0.0.1:%d", pubPort), Replay: fmt.Sprintf("tcp://127.0.0.1:%d", replayPort),
		Apply: idx.ApplyKV, Clear: idx.ClearKV, Probe: time.Second, Silence: 300 * time.Millisecond,
		Timeout: 500 * time.Millisecond, Log: logr.Discard(),
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go s.Run(ctx)
	engine.publishCh <- batch(t, stored("b0"))
	eventually(t, "the first block", func() bool { return idx.Prefix([]string{"b0"}) == 1 })
	for i := 1; i <= 20; i++ { // 1 s of traffic, a batch every 50 ms
		time.Sleep(50 * time.Millisecond)
		engine.publishCh <- batch(t, stored(fmt.Sprintf("b%d", i)))
	}
	eventually(t, "the last block", func() bool { return idx.Prefix([]string{"b20"}) == 1 })
	if !s.Live() {
		t.Fatal("a stream whose batches keep arriving was distrusted")
	}
}
