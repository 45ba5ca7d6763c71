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

// pod is what the scorer knows of one engine: its index and the two streams that feed it.
type pod struct {
	index    *events.Index
	kv, mm   *events.Stream
	cancel   context.CancelFunc
	lastUsed time.Time // guarded by pods.mu
}

// pods follows each candidate pod's event streams from the first time it is scored.
//
// Invariant: get never blocks on the network; the streams connect in their own goroutines.
type pods struct {
	ctx    context.Context
	params Params
	log    logr.Logger
	mu     sync.Mutex
	byAddr map[string]*pod
}

func newPods(ctx context.Context, p Params, logger logr.Logger) *pods {
	ps := &pods{ctx: ctx, params: p, log: logger, byAddr: map[string]*pod{}}
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
			Pub: tcp(addr, ps.params.KVEventsPort), Replay: tcp(addr, ps.params.KVReplayPort),
			Apply: idx.ApplyKV, Clear: idx.ClearKV, Silence: silence, Log: logger,
		},
		mm: &events.Stream{
			Pub: tcp(addr, ps.params.MMEventsPort), Replay: tcp(addr, ps.params.MMReplayPort),
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
	tick := time.NewTicker(time.Minute)
	defer tick.Stop()
	for {
		select {
		case <-ps.ctx.Done():
			return
		case <-tick.C:
		}
		ps.mu.Lock()
		for addr, p := range ps.byAddr {
			if time.Since(p.lastUsed) > idleAfter {
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
