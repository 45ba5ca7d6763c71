package mmiscache

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"mmis.dev/router/pkg/events/eventstest"
)

// frontEnds serves POST /internal/block_keys on each of addrs at one port, as P0's
// operations port does, answering what answer returns for the address asked; every request's
// address and Authorization header are recorded.
type frontEnds struct {
	port   int
	mu     sync.Mutex
	asked  []string // the addresses asked, in order
	auths  []string // their Authorization headers
	answer func(addr string, w http.ResponseWriter)
}

func serveFrontEnds(t *testing.T, addrs []string, answer func(addr string, w http.ResponseWriter)) *frontEnds {
	t.Helper()
	fe := &frontEnds{answer: answer}
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, _, _ := net.SplitHostPort(r.Host)
		fe.mu.Lock()
		fe.asked = append(fe.asked, host)
		fe.auths = append(fe.auths, r.Header.Get("Authorization"))
		fe.mu.Unlock()
		if r.Method != http.MethodPost || r.URL.Path != "/internal/block_keys" {
			http.Error(w, "not found", http.StatusNotFound)
			return
		}
		fe.answer(host, w)
	})
	for attempt := 0; ; attempt++ { // one port free on every address
		fe.port = eventstest.FreePort(t, addrs[0])
		var ls []net.Listener
		for _, a := range addrs {
			l, err := net.Listen("tcp", net.JoinHostPort(a, fmt.Sprint(fe.port)))
			if err != nil {
				break
			}
			ls = append(ls, l)
		}
		if len(ls) == len(addrs) {
			for _, l := range ls {
				srv := &http.Server{Handler: handler, ReadHeaderTimeout: 5 * time.Second}
				go func() { _ = srv.Serve(l) }()
				t.Cleanup(func() { srv.Close() })
			}
			return fe
		}
		for _, l := range ls {
			l.Close()
		}
		if attempt > 20 {
			t.Fatal("no port free on every address")
		}
	}
}

func (fe *frontEnds) log() ([]string, []string) {
	fe.mu.Lock()
	defer fe.mu.Unlock()
	return append([]string(nil), fe.asked...), append([]string(nil), fe.auths...)
}

func keysAnswer(blocks []string, items []string) func(string, http.ResponseWriter) {
	return func(_ string, w http.ResponseWriter) {
		hexed := make([]string, len(blocks))
		for i, b := range blocks {
			hexed[i] = hex.EncodeToString([]byte(b))
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"block_size": 16, "block_keys": hexed, "mm_hashes": items})
	}
}

var threeAddrs = []string{"127.0.0.2", "127.0.0.3", "127.0.0.4"}

func TestKeysCarryTheTokenOnlyWhenOneIsSet(t *testing.T) {
	fe := serveFrontEnds(t, threeAddrs[:1], keysAnswer([]string{"block-0"}, []string{"img"}))
	for _, token := range []string{"s3cret", ""} {
		c := newKeysClient(fe.port, 2*time.Second, token)
		k, err := c.fetch(context.Background(), threeAddrs[:1], []byte(`{}`), 0)
		if err != nil {
			t.Fatal(err)
		}
		if len(k.blocks) != 1 || k.blocks[0] != "block-0" || len(k.items) != 1 || k.items[0] != "img" {
			t.Errorf("keys %+v", k)
		}
	}
	_, auths := fe.log()
	if auths[0] != "Bearer s3cret" || auths[1] != "" {
		t.Errorf("Authorization headers %q, want [\"Bearer s3cret\", \"\"]", auths)
	}
}

func TestAKeysFetchIsBoundedByItsTimeout(t *testing.T) {
	fe := serveFrontEnds(t, threeAddrs, func(string, http.ResponseWriter) { time.Sleep(3 * time.Second) })
	c := newKeysClient(fe.port, 200*time.Millisecond, "")
	start := time.Now()
	_, err := c.fetch(context.Background(), threeAddrs, []byte(`{}`), 0)
	if err == nil {
		t.Fatal("a front end that never answers gave keys")
	}
	if took := time.Since(start); took > 1500*time.Millisecond {
		t.Errorf("the fetch took %s with a 200 ms budget for all candidates", took)
	}
}

func TestKeysRotateOverTheFrontEndsAndFollowTheImages(t *testing.T) {
	fe := serveFrontEnds(t, threeAddrs, keysAnswer(nil, nil))
	c := newKeysClient(fe.port, 2*time.Second, "")
	shuffled := []string{threeAddrs[2], threeAddrs[0], threeAddrs[1]}
	for range 3 {
		if _, err := c.fetch(context.Background(), shuffled, []byte(`{}`), 0); err != nil {
			t.Fatal(err)
		}
	}
	asked, _ := fe.log()
	if seen := map[string]bool{asked[0]: true, asked[1]: true, asked[2]: true}; len(seen) != 3 {
		t.Errorf("three requests without images asked %v, want each front end once", asked)
	}
	for range 3 { // one image: always the front end it hashes to, over the sorted addresses
		if _, err := c.fetch(context.Background(), shuffled, []byte(`{}`), 7); err != nil {
			t.Fatal(err)
		}
	}
	asked, _ = fe.log()
	for _, a := range asked[3:] {
		if a != threeAddrs[7%3] {
			t.Errorf("requests with one image asked %v, want %s each time", asked[3:], threeAddrs[7%3])
		}
	}
}

func TestAFailingFrontEndPassesTheAskToTheNext(t *testing.T) {
	fe := serveFrontEnds(t, threeAddrs, func(addr string, w http.ResponseWriter) {
		if addr == threeAddrs[1] {
			http.Error(w, `{"error": "down"}`, http.StatusServiceUnavailable)
			return
		}
		keysAnswer([]string{"k"}, nil)(addr, w)
	})
	c := newKeysClient(fe.port, 2*time.Second, "")
	k, err := c.fetch(context.Background(), threeAddrs, []byte(`{}`), 1) // starts at threeAddrs[1]
	if err != nil || len(k.blocks) != 1 {
		t.Fatalf("keys %+v, %v", k, err)
	}
	if asked, _ := fe.log(); len(asked) != 2 || asked[0] != threeAddrs[1] || asked[1] != threeAddrs[2] {
		t.Errorf("asked %v, want the failing one then the next", asked)
	}
}

func TestABadKeysAnswerIsAnError(t *testing.T) {
	for name, answer := range map[string]func(string, http.ResponseWriter){
		"not json":       func(_ string, w http.ResponseWriter) { _, _ = w.Write([]byte("<html>")) },
		"a key not hex":  func(_ string, w http.ResponseWriter) { _, _ = w.Write([]byte(`{"block_keys": ["zz"]}`)) },
		"401 (no token)": func(_ string, w http.ResponseWriter) { http.Error(w, "who are you", 401) },
	} {
		fe := serveFrontEnds(t, threeAddrs[:1], answer)
		_, err := newKeysClient(fe.port, time.Second, "").fetch(context.Background(), threeAddrs[:1], []byte(`{}`), 0)
		if err == nil {
			t.Errorf("%s: no error", name)
		} else if name == "401 (no token)" && !strings.Contains(err.Error(), "401") {
			t.Errorf("%s: %v does not say the status", name, err)
		}
	}
	if _, err := newKeysClient(1, time.Second, "").fetch(context.Background(), nil, nil, 0); err == nil {
		t.Error("no candidates: no error")
	}
}
