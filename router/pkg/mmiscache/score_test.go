package mmiscache

import (
	"context"
	"fmt"
	"net"
	"runtime"
	"testing"
	"time"

	fwkdl "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/datalayer"
	framework "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/scheduling"

	"mmis.dev/router/pkg/events/eventstest"
)

// commonPorts are n TCP ports free on every one of addrs now.
func commonPorts(t *testing.T, n int, addrs []string) []int {
	t.Helper()
	var ports []int
	for len(ports) < n {
		p := eventstest.FreePort(t, addrs[0])
		ok := true
		for _, a := range addrs[1:] {
			l, err := net.Listen("tcp", net.JoinHostPort(a, fmt.Sprint(p)))
			if err != nil {
				ok = false
				break
			}
			l.Close()
		}
		if ok {
			ports = append(ports, p)
		}
	}
	return ports
}

func chatRequest() *framework.LLMRequest {
	return &framework.LLMRequest{Body: &framework.LLMRequestBody{
		ChatCompletions: &framework.ChatCompletionsRequest{},
		Payload: framework.PayloadMap{"model": "tiny", "messages": []any{
			map[string]any{"role": "user", "content": "hello"}}},
	}}
}

// The scorer end to end, with real streams: two engines and one hostile "engine" (every
// socket answers frames claiming a tebibyte, batches claiming 67M elements, garbage). The
// holder of a request's prefix and image scores highest, the hostile pod scores 0 and costs
// bounded memory, and scoring goes on throughout (issue 41 item 3, the Go-level check).
func TestTheScorerFollowsItsEnginesAndSurvivesAHostileOne(t *testing.T) {
	good, other, bad := threeAddrs[0], threeAddrs[1], threeAddrs[2]
	ports := commonPorts(t, 4, threeAddrs)
	fe := serveFrontEnds(t, threeAddrs, keysAnswer([]string{"b0", "b1"}, []string{"img"}))
	p := Params{KVEventsPort: ports[0], KVReplayPort: ports[1], MMEventsPort: ports[2], MMReplayPort: ports[3],
		KeysPort: fe.port, KeysTimeoutMs: 2000, SilenceSeconds: 2}

	goodKV := eventstest.Start(t, good, p.KVEventsPort, p.KVReplayPort)
	goodMM := eventstest.Start(t, good, p.MMEventsPort, p.MMReplayPort)
	otherKV := eventstest.Start(t, other, p.KVEventsPort, p.KVReplayPort)
	otherMM := eventstest.Start(t, other, p.MMEventsPort, p.MMReplayPort)
	goodKV.Publish(eventstest.Batch(t, eventstest.Cleared, eventstest.Stored("b0", "b1")))
	goodMM.Publish(eventstest.Batch(t, eventstest.Epoch("e1"), eventstest.ItemStored("img")))
	otherKV.Publish(eventstest.Batch(t, eventstest.Cleared, eventstest.Stored("b0")))
	otherMM.Publish(eventstest.Batch(t, eventstest.Epoch("e2")))
	seq := make([]byte, 8)
	hostile := [][]byte{
		eventstest.HugeFrame,
		eventstest.Message([]byte{}, []byte{}, seq, []byte{0xdd, 0x04, 0x00, 0x00, 0x00}),
		eventstest.Message([]byte{}, seq, []byte{0xdd, 0x04, 0x00, 0x00, 0x00}),
		eventstest.Message([]byte{}, []byte{}, seq, nested(2<<20)),
		[]byte("\x00\x00garbage that is not ZMTP at all"),
	}
	for i, port := range ports {
		kind := []string{"PUB", "ROUTER"}[i%2]
		eventstest.Raw(t, bad, port, kind, 300*time.Millisecond, hostile...)
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := newScorer(ctx, "", p, "")
	var endpoints []framework.Endpoint
	for _, a := range threeAddrs {
		endpoints = append(endpoints, framework.NewEndpoint(&fwkdl.EndpointMetadata{Address: a}, &fwkdl.Metrics{}, nil))
	}
	score := func() map[string]float64 { return describe(s.Score(ctx, nil, chatRequest(), endpoints)) }

	want := map[string]float64{good: 1, other: kvWeight * 0.5, bad: 0}
	var peak uint64
	deadline := time.Now().Add(15 * time.Second)
	for settled := 0; settled < 20; { // 20 scorings in a row as expected, with the hostile pod answering throughout
		got := score()
		if near(got[good], want[good]) && near(got[other], want[other]) && got[bad] == 0 {
			settled++
		} else {
			settled = 0
		}
		if time.Now().After(deadline) {
			t.Fatalf("scores %v, want %v", got, want)
		}
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		peak = max(peak, m.HeapAlloc)
		time.Sleep(100 * time.Millisecond)
	}
	if peak > 256<<20 {
		t.Errorf("the picker's heap reached %d MiB", peak>>20)
	}
	t.Logf("peak heap %d MiB", peak>>20)
	if asked, _ := fe.log(); len(asked) == 0 {
		t.Error("no keys were asked for")
	}
}

func nested(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = 0x91
	}
	return b
}
