package events

import (
	"context"
	"net"
	"strings"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// boundedTCP is ZMQ over TCP whose connection carries the dialling context's deadline, so
// the ZMTP handshake and every read and write of a replay are bounded too: an engine that is
// stopped (SIGSTOP) still accepts TCP connections in its kernel but never greets, and an
// unbounded handshake would hang the stream's goroutine for as long as the engine is stopped.
type boundedTCP struct{ tcp transport.Transport }

const boundedScheme = "mmis-bounded-tcp"

func init() {
	if err := zmq4.RegisterTransport(boundedScheme, boundedTCP{transport.New("tcp")}); err != nil {
		panic(err)
	}
}

func (t boundedTCP) Dial(ctx context.Context, dialer transport.Dialer, addr string) (net.Conn, error) {
	conn, err := dialer.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	if deadline, ok := ctx.Deadline(); ok {
		if err := conn.SetDeadline(deadline); err != nil {
			conn.Close()
			return nil, err
		}
	}
	return conn, nil
}

func (t boundedTCP) Listen(ctx context.Context, addr string) (net.Listener, error) {
	return t.tcp.Listen(ctx, addr)
}

func (t boundedTCP) Addr(ep string) (string, error) { return t.tcp.Addr(ep) }

// bounded turns tcp://host:port into the same address over boundedTCP.
func bounded(endpoint string) string {
	return boundedScheme + "://" + strings.TrimPrefix(endpoint, "tcp://")
}
