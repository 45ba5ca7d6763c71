package events

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
)

// python is an interpreter with pyzmq and msgspec (MMIS_PYTHON, else the repository's
// .venv); without one the test skips, or fails under CI=true.
func python(t *testing.T) string {
	t.Helper()
	candidates := []string{os.Getenv("MMIS_PYTHON"), filepath.Join("..", "..", "..", ".venv", "bin", "python")}
	for _, p := range candidates {
		if p == "" {
			continue
		}
		if exec.Command(p, "-c", "import zmq, msgspec").Run() == nil {
			return p
		}
	}
	if ci := strings.ToLower(os.Getenv("CI")); ci == "1" || ci == "true" || ci == "yes" {
		t.Fatal("CI=true: no Python with pyzmq and msgspec (set MMIS_PYTHON)")
	}
	t.Skip("no Python with pyzmq and msgspec (set MMIS_PYTHON)")
	return ""
}

// plainEngine runs testdata/plain_engine.py: libzmq's PLAIN server with a ZAP handler
// admitting user "mmis" with token. It returns the endpoints and the ZAP decisions so far.
func plainEngine(t *testing.T, token string) (pub, replay string, decisions func() []string) {
	t.Helper()
	cmd := exec.Command(python(t), filepath.Join("testdata", "plain_engine.py"), token)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		stdin.Close()
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			_ = cmd.Process.Kill()
		}
	})
	lines := bufio.NewScanner(stdout)
	if !lines.Scan() {
		t.Fatal("plain_engine.py said nothing")
	}
	var pubPort, replayPort int
	if _, err := fmt.Sscanf(lines.Text(), "ports %d %d", &pubPort, &replayPort); err != nil {
		t.Fatalf("plain_engine.py: %q: %v", lines.Text(), err)
	}
	var mu sync.Mutex
	var zap []string
	go func() {
		for lines.Scan() {
			mu.Lock()
			zap = append(zap, lines.Text())
			mu.Unlock()
		}
	}()
	return fmt.Sprintf("tcp://127.0.0.1:%d", pubPort), fmt.Sprintf("tcp://127.0.0.1:%d", replayPort),
		func() []string { mu.Lock(); defer mu.Unlock(); return append([]string(nil), zap...) }
}

// The picker's go-zeromq PLAIN client against libzmq's PLAIN server and a ZAP handler (what
// the engine runs with MMIS_ENGINE_EVENTS_TOKEN): the right token gets the replay and the
// live batches; a wrong token or none gets nothing, and the stream is distrusted.
func TestPlainCredentialsOpenLibzmqEventSockets(t *testing.T) {
	pub, replay, decisions := plainEngine(t, "the-token")
	follow := func(token string) (*Stream, *Index, context.CancelFunc) {
		idx := NewIndex()
		s := &Stream{Pub: pub, Replay: replay, Token: token, Apply: idx.ApplyKV, Clear: idx.ClearKV,
			Probe: time.Minute, Silence: time.Second, Timeout: 2 * time.Second, Log: logr.Discard()}
		ctx, cancel := context.WithCancel(context.Background())
		go s.Run(ctx)
		return s, idx, cancel
	}
	s, idx, cancel := follow("the-token")
	defer cancel()
	eventually(t, "the replayed block", func() bool { return idx.Prefix([]string{"plain-block"}) == 1 })
	// no probe runs (Probe is a minute): blocks published later arrive on the PLAIN subscription
	applied := func() int { b, _, _ := idx.Sizes(); return b }
	after := applied()
	eventually(t, "live blocks over PLAIN", func() bool { return applied() >= after+3 })
	if !s.Live() {
		t.Error("a stream with the right token is distrusted")
	}

	for _, token := range []string{"a-wrong-token", ""} {
		s, idx, cancel := follow(token)
		time.Sleep(2500 * time.Millisecond) // past Silence, several replays tried
		cancel()
		if b, _, _ := idx.Sizes(); b != 0 || s.Live() {
			t.Errorf("token %q: %d blocks applied, trusted %v", token, b, s.Live())
		}
	}
	refused := 0
	for _, d := range decisions() {
		if strings.HasPrefix(d, "zap 400") {
			refused++
		}
	}
	if refused == 0 {
		t.Errorf("the ZAP handler refused nobody: %v", decisions())
	}
}
