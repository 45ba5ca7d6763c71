package mmiscache

import (
	"context"
	"testing"
	"time"

	"github.com/go-logr/logr"

	"mmis.dev/router/pkg/events"
)

func TestAPodIsFollowedOnceOnItsPortsWithTheToken(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	p := defaultParams()
	ps := newPods(ctx, p, "tok", logr.Discard())
	a := ps.get("10.0.0.7")
	if ps.get("10.0.0.7") != a {
		t.Error("a pod scored twice is followed twice")
	}
	if ps.get("10.0.0.8") == a {
		t.Error("two pods share one follower")
	}
	kv, mm := a.kv.(*events.Stream), a.mm.(*events.Stream)
	for _, c := range []struct{ got, want string }{
		{kv.Pub, "tcp://10.0.0.7:5557"}, {kv.Replay, "tcp://10.0.0.7:5558"},
		{mm.Pub, "tcp://10.0.0.7:5559"}, {mm.Replay, "tcp://10.0.0.7:5560"},
		{kv.Token, "tok"}, {mm.Token, "tok"},
	} {
		if c.got != c.want {
			t.Errorf("got %q, want %q", c.got, c.want)
		}
	}
	if kv.Silence != 10*time.Second {
		t.Errorf("silence %s, want silenceSeconds", kv.Silence)
	}
	if ipv6 := ps.get("fd00::1").kv.(*events.Stream).Pub; ipv6 != "tcp://[fd00::1]:5557" {
		t.Errorf("an IPv6 pod's stream is %s", ipv6)
	}
}

func TestAPodNoLongerACandidateIsForgotten(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ps := startPods(&pods{ctx: ctx, params: defaultParams(), log: logr.Discard(),
		idleAfter: 200 * time.Millisecond, sweep: 50 * time.Millisecond})
	gone := ps.get("10.0.0.9")
	kept := ps.get("10.0.0.10")
	deadline := time.Now().Add(5 * time.Second)
	for {
		ps.get("10.0.0.10") // still a candidate
		ps.mu.Lock()
		_, stillGone := ps.byAddr["10.0.0.9"]
		_, stillKept := ps.byAddr["10.0.0.10"]
		ps.mu.Unlock()
		if !stillKept {
			t.Fatal("a pod scored every 20 ms was forgotten")
		}
		if !stillGone {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("an idle pod is still followed")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if ps.get("10.0.0.9") == gone || ps.get("10.0.0.10") != kept {
		t.Error("a forgotten pod that comes back is followed anew; a kept one stays")
	}
}
