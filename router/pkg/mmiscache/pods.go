package mmiscache

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/go-logr/logr"

	"mmis.dev/router/pkg/events"
)

// idleAfter: a pod that has not been a candidate for this long stops being followed (it left
// the pool); it is followed again, from a replay, if it comes back.
const idleAfter = 10 * time.Minute

// follower is one event stream of a pod (an *events.Stream; a fixed one in unit tests).
type follower interface {
	Run(ctx context.Context)
	Live() bool
}

// pod is what the scorer knows of one engine: its index and the two streams that feed it.
type pod struct {
	index    *events.Index
	kv, mm   follower
	cancel   context.CancelFunc
	lastUsed time.Time // guarded by pods.mu
}

// pods follows each candidate pod's event streams from the first time it is scored.
//
// Invariants: get never blocks on the network; the streams connect in their own goroutines
// (events.Stream: a panic there drops that stream, never the picker). Every stream presents
// token (the internal token; "": none).
type pods struct {
	ctx       context.Context
	params    Params
	token     string
	log       logr.Logger
	idleAfter time.Duration // a pod unused this long is forgotten (the const; shorter in tests)
	sweep     time.Duration // how often idle pods are looked for
	mu        sync.Mutex
	byAddr    map[string]*pod
}

func newPods(ctx context.Context, p Params, token string, logger logr.Logger) *pods {
	return startPods(&pods{ctx: ctx, params: p, token: token, log: logger, idleAfter: idleAfter,
		sweep: time.Minute})
}

func startPods(ps *pods) *pods {
	ps.byAddr = map[string]*pod{}
	go ps.janitor()
	return ps
}

func tcp(addr string, port int) string {
	return fmt.Sprintf("tcp://%s", net.JoinHostPort(addr, strconv.Itoa(port)))
}

func (ps *pods) get(addr string) *pod {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if p, ok := ps.byAddr[addr]; ok {
		p.lastUsed = time.Now()
		return p
	}
	ctx, cancel := context.WithCancel(ps.ctx)
	idx := events.NewIndex()
	silence := time.Duration(ps.params.SilenceSeconds * float64(time.Second))
	logger := ps.log.WithValues("pod", addr)
	p := &pod{
		index: idx,
		kv: &events.Stream{
			Pub: tcp(addr, ps.params.KVEventsPort), Replay: tcp(addr, ps.params.KVReplayPort), Token: ps.token,
			Apply: idx.ApplyKV, Clear: idx.ClearKV, Silence: silence, Log: logger,
		},
		mm: &events.Stream{
			Pub: tcp(addr, ps.params.MMEventsPort), Replay: tcp(addr, ps.params.MMReplayPort), Token: ps.token,
			Apply: idx.ApplyMM, Clear: idx.ClearMM, Silence: silence, Log: logger,
		},
		cancel:   cancel,
		lastUsed: time.Now(),
	}
	go p.kv.Run(ctx)
	go p.mm.Run(ctx)
	ps.byAddr[addr] = p
	logger.Info("following the pod's cache events")
	return p
}

func (ps *pods) janitor() {
	tick := time.NewTicker(ps.sweep)
	defer tick.Stop()
	for {
		select {
		case <-ps.ctx.Done():
			return
		case <-tick.C:
		}
		ps.mu.Lock()
		for addr, p := range ps.byAddr {
			if time.Since(p.lastUsed) > ps.idleAfter {
				p.cancel()
				delete(ps.byAddr, addr)
			}
		}
		ps.mu.Unlock()
	}
}

// score is kvWeight * cached prefix fraction + mmWeight * held image fraction, over the parts
// the request has, counting a part only while its stream is trusted.
func (p *pod) score(k *requestKeys) float64 {
	var total, got float64
	if n := len(k.blocks); n > 0 {
		total += kvWeight
		if p.kv.Live() {
			got += kvWeight * float64(p.index.Prefix(k.blocks)) / float64(n)
		}
	}
	if n := len(k.items); n > 0 {
		total += mmWeight
		if p.mm.Live() {
			got += mmWeight * float64(p.index.Items(k.items)) / float64(n)
		}
	}
	if total == 0 {
		return 0
	}
	return got / total
}
