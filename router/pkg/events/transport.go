package events

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/plain"
	"github.com/go-zeromq/zmq4/transport"
)

// The picker's ZMQ connections (both the SUB and the replay DEALER) go through the transports
// registered here, never through go-zeromq's plain "tcp".
//
// Why a wrapper: go-zeromq v0.17.0 reads a frame (conn.go, (*Conn).read) by taking the size
// from its header (1 byte, or 8 bytes with the LONG flag) and calling make([]byte, size)
// before reading the body; its only check is size <= MaxInt64. So a peer that sends a frame
// header claiming 2^40 bytes makes the picker allocate 1 TiB (a fatal, unrecoverable
// out-of-memory: recover cannot catch it), and one that sends endless MORE frames grows a
// message without bound. It has no option for a maximum message size (libzmq's
// ZMQ_MAXMSGSIZE). cappedConn parses the ZMTP 3.x stream on the read side as it passes
// through and fails the connection when a frame or a message exceeds the caps, before
// go-zeromq has seen the size.
//
// Invariants:
//   - Read never returns the bytes of a frame header whose size exceeds MaxFrameBytes, of a
//     frame that would take its message past MaxMessageBytes, or of a message's
//     MaxMessageFrames+1-th frame; the connection is closed and every later Read and Write
//     fails with *FrameError.
//   - A replay connection (mmis-bounded-tcp) carries its dialling context's deadline for its
//     whole life: an engine that is stopped (SIGSTOP) still accepts TCP connections in its
//     kernel but never greets, and an unbounded handshake would hang a stream's goroutine
//     for as long as the engine is stopped.
//   - A subscription (mmis-sub-tcp) is bounded the same way until the peer's READY command
//     (the end of the ZMTP handshake, NULL or PLAIN), then has no deadline: a quiet engine
//     is not a dead one.
//   - Every connection is closed when its socket's context ends, including one whose
//     handshake failed (go-zeromq does not close those).

const (
	// MaxFrameBytes is the largest ZMTP frame body read: one batch.
	MaxFrameBytes = MaxBatchBytes
	// MaxMessageBytes bounds one multipart message: a batch plus its small frames (a replay
	// answer is [empty, topic, seq, payload]).
	MaxMessageBytes = MaxBatchBytes + 64<<10
	// MaxMessageFrames bounds the frames of one message (a replay answer has 4).
	MaxMessageFrames = 16
	// PlainUser is the PLAIN user name the picker presents (engine/event_auth.py's USER).
	PlainUser = "mmis"

	zmtpGreeting  = 64
	flagMore      = 0x01
	flagLong      = 0x02
	flagCommand   = 0x04
	boundedScheme = "mmis-bounded-tcp" // replays: the context's deadline for the whole connection
	subScheme     = "mmis-sub-tcp"     // subscriptions: a deadline until the handshake is done
)

// FrameError is a peer's ZMTP stream that the picker refuses to read on.
type FrameError struct{ Why string }

func (e *FrameError) Error() string { return "zmtp: " + e.Why + "; connection closed" }

// Timeout and Temporary make a FrameError a net.Error that go-zeromq treats as a closed
// connection (conn.go, checkIO), so the socket drops it.
func (e *FrameError) Timeout() bool   { return false }
func (e *FrameError) Temporary() bool { return false }

var _ net.Error = (*FrameError)(nil)

// cappedConn is a net.Conn whose read side is parsed as ZMTP 3.x: the 64-byte greeting,
// then frames (flags byte, 1- or 8-byte size, body).
type cappedConn struct {
	net.Conn
	onReady func() // called once the peer's READY command has been read

	mu        sync.Mutex // Read is called from one goroutine at a time; the lock is for err
	err       error
	greeting  int // greeting bytes still to come
	hdr       [9]byte
	hdrLen    int    // header bytes read of the current frame
	body      uint64 // body bytes still to come of the current frame
	more      bool   // the current frame has MORE
	command   bool   // the current frame is a command
	cmd       [6]byte
	cmdLen    int
	msgBytes  uint64 // bytes of the current message so far
	msgFrames int
	stop      func() bool
	closeOnce sync.Once
}

func newCappedConn(c net.Conn, onReady func()) *cappedConn {
	return &cappedConn{Conn: c, onReady: onReady, greeting: zmtpGreeting}
}

func (c *cappedConn) Read(p []byte) (int, error) {
	if err := c.failed(); err != nil {
		return 0, err
	}
	n, rerr := c.Conn.Read(p)
	if err := c.scan(p[:n]); err != nil {
		c.mu.Lock()
		c.err = err
		c.mu.Unlock()
		_ = c.Close()
		return 0, err
	}
	return n, rerr
}

// Write fails with the read side's *FrameError once there is one: a peer that sent an
// oversized frame header is refused for that reason, whichever of the two sides of the
// connection notices first (a send racing the read would otherwise report only "use of
// closed network connection").
func (c *cappedConn) Write(p []byte) (int, error) {
	if err := c.failed(); err != nil {
		return 0, err
	}
	n, err := c.Conn.Write(p)
	if err != nil {
		if ferr := c.failed(); ferr != nil {
			return n, ferr
		}
	}
	return n, err
}

func (c *cappedConn) failed() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

func (c *cappedConn) Close() error {
	var err error
	c.closeOnce.Do(func() {
		if c.stop != nil {
			c.stop()
		}
		err = c.Conn.Close()
	})
	return err
}

// scan follows the stream through b (bytes just read), failing on a frame over the caps.
func (c *cappedConn) scan(b []byte) error {
	for len(b) > 0 {
		switch {
		case c.greeting > 0:
			k := min(c.greeting, len(b))
			if c.greeting == zmtpGreeting && b[0] != 0xff {
				return &FrameError{Why: fmt.Sprintf("greeting starts with 0x%02x, not ZMTP's 0xff", b[0])}
			}
			c.greeting -= k
			b = b[k:]
		case c.body > 0:
			k := int(min(c.body, uint64(len(b))))
			if c.command && c.cmdLen < len(c.cmd) {
				c.cmdLen += copy(c.cmd[c.cmdLen:], b[:k])
			}
			c.body -= uint64(k)
			b = b[k:]
			if c.body == 0 {
				c.frameDone()
			}
		default:
			c.hdr[c.hdrLen] = b[0]
			c.hdrLen++
			b = b[1:]
			flags := c.hdr[0]
			if c.hdrLen == 1 && flags&^(flagMore|flagLong|flagCommand) != 0 {
				return &FrameError{Why: fmt.Sprintf("frame flags 0x%02x have reserved bits set", flags)}
			}
			want := 2
			if flags&flagLong != 0 {
				want = 9
			}
			if c.hdrLen < want {
				continue
			}
			size := uint64(c.hdr[1])
			if want == 9 {
				size = binary.BigEndian.Uint64(c.hdr[1:9])
			}
			c.hdrLen = 0
			if err := c.frameStarts(flags, size); err != nil {
				return err
			}
			if size == 0 {
				c.frameDone()
			}
		}
	}
	return nil
}

func (c *cappedConn) frameStarts(flags byte, size uint64) error {
	if size > MaxFrameBytes {
		return &FrameError{Why: fmt.Sprintf("a frame of %d bytes claimed, at most %d are read", size, MaxFrameBytes)}
	}
	if c.msgFrames >= MaxMessageFrames {
		return &FrameError{Why: fmt.Sprintf("a message of more than %d frames", MaxMessageFrames)}
	}
	if c.msgBytes+size > MaxMessageBytes {
		return &FrameError{Why: fmt.Sprintf("a message of more than %d bytes", MaxMessageBytes)}
	}
	c.msgFrames++
	c.msgBytes += size
	c.body = size
	c.more = flags&flagMore != 0
	c.command = flags&flagCommand != 0
	c.cmdLen = 0
	return nil
}

func (c *cappedConn) frameDone() {
	if c.command && c.cmdLen == len(c.cmd) && string(c.cmd[:]) == "\x05READY" && c.onReady != nil {
		c.onReady()
		c.onReady = nil
	}
	if !c.more || c.command {
		c.msgBytes, c.msgFrames = 0, 0
	}
}

// handshakeKey carries, in a socket's context, how long a subscription's handshake may take.
type handshakeKey struct{}

// cappedTCP is ZMQ over TCP through a cappedConn. whole: the context's deadline bounds the
// whole connection (replays); otherwise only the handshake is bounded (subscriptions).
type cappedTCP struct {
	tcp   transport.Transport
	whole bool
}

func init() {
	for scheme, whole := range map[string]bool{boundedScheme: true, subScheme: false} {
		if err := zmq4.RegisterTransport(scheme, cappedTCP{transport.New("tcp"), whole}); err != nil {
			panic(err)
		}
	}
}

func (t cappedTCP) Dial(ctx context.Context, dialer transport.Dialer, addr string) (net.Conn, error) {
	raw, err := dialer.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	var onReady func()
	deadline, ok := ctx.Deadline()
	if !t.whole {
		budget, _ := ctx.Value(handshakeKey{}).(time.Duration)
		if budget <= 0 {
			budget = 5 * time.Second
		}
		deadline, ok = time.Now().Add(budget), true
		onReady = func() { _ = raw.SetDeadline(time.Time{}) }
	}
	if ok {
		if err := raw.SetDeadline(deadline); err != nil {
			raw.Close()
			return nil, err
		}
	}
	conn := newCappedConn(raw, onReady)
	conn.stop = context.AfterFunc(ctx, func() { _ = conn.Close() })
	return conn, nil
}

func (t cappedTCP) Listen(ctx context.Context, addr string) (net.Listener, error) {
	return t.tcp.Listen(ctx, addr)
}

func (t cappedTCP) Addr(ep string) (string, error) { return t.tcp.Addr(ep) }

// bounded turns tcp://host:port into the same address over the replay transport.
func bounded(endpoint string) string {
	return boundedScheme + "://" + strings.TrimPrefix(endpoint, "tcp://")
}

// subscription turns tcp://host:port into the same address over the subscription transport.
func subscription(endpoint string) string {
	return subScheme + "://" + strings.TrimPrefix(endpoint, "tcp://")
}

// HandshakeError is a ZMTP handshake that made go-zeromq panic: v0.17.0 panics in
// SocketType.IsCompatible when the peer's READY names a socket type it does not know (found
// by FuzzStream). The connection is refused like any failed handshake.
type HandshakeError struct{ Panic any }

func (e *HandshakeError) Error() string {
	return fmt.Sprintf("zmtp: the handshake made go-zeromq panic (%v); connection refused", e.Panic)
}

// handshake runs f (a socket's Dial, or zmq4.Open: the ZMTP handshake happens there, in the
// caller's goroutine) and turns a panic in it into a *HandshakeError. No go-zeromq lock is
// held while it handshakes, and the connection is closed with its socket's context.
func handshake(f func() error) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &HandshakeError{Panic: v}
		}
	}()
	return f()
}

// security is the mechanism the picker connects with: PLAIN with user PlainUser and the
// internal token as password when there is a token (docs/SECURITY.md), NULL otherwise.
func security(token string) zmq4.Security {
	if token == "" {
		return nil
	}
	return plainClient{user: PlainUser, pass: token}
}

// plainClient is ZMQ PLAIN as a client, fresh for every handshake: go-zeromq's
// security/plain forgets its credentials after its first handshake (v0.17.0 sets user and
// pass to nil), so a socket that connects again would present empty ones.
type plainClient struct{ user, pass string }

func (p plainClient) Type() zmq4.SecurityType { return zmq4.PlainSecurity }

func (p plainClient) Handshake(conn *zmq4.Conn, server bool) error {
	if server {
		return errors.New("the picker's PLAIN is a client only")
	}
	return plain.Security(p.user, p.pass).Handshake(conn, false)
}

func (p plainClient) Encrypt(w io.Writer, data []byte) (int, error) { return w.Write(data) }
func (p plainClient) Decrypt(w io.Writer, data []byte) (int, error) { return w.Write(data) }
