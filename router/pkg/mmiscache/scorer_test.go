package mmiscache

import (
	"context"
	"encoding/json"
	"math"
	"strings"
	"testing"

	"mmis.dev/router/pkg/events"
)

// fixed is a stream whose trust a test sets.
type fixed bool

func (f fixed) Run(context.Context) {}
func (f fixed) Live() bool          { return bool(f) }

func near(a, b float64) bool { return math.Abs(a-b) < 1e-9 }

func TestFactoryChecksItsParameters(t *testing.T) {
	plugin, err := Factory("cache", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := plugin.(*Scorer).params; got != defaultParams() {
		t.Errorf("no parameters: %+v, want the defaults", got)
	}
	plugin, err = Factory("cache", json.RawMessage(`{"keysPort": 9001, "silenceSeconds": 2.5}`), nil)
	if err != nil {
		t.Fatal(err)
	}
	want := defaultParams()
	want.KeysPort, want.SilenceSeconds = 9001, 2.5
	if got := plugin.(*Scorer).params; got != want {
		t.Errorf("some parameters: %+v, want %+v (the rest at their defaults)", got, want)
	}
	for raw, why := range map[string]string{
		`{"kvEventsPort": 0}`:      "out of range",
		`{"mmReplayPort": 65536}`:  "out of range",
		`{"keysPort": -1}`:         "out of range",
		`{"keysTimeoutMs": 0}`:     "must be positive",
		`{"silenceSeconds": -1}`:   "must be positive",
		`{"kvEventsPort": "5557"}`: "parameters",
		`[1, 2]`:                   "parameters",
	} {
		if _, err := Factory("cache", json.RawMessage(raw), nil); err == nil || !strings.Contains(err.Error(), why) {
			t.Errorf("%s: %v, want an error saying %q", raw, err, why)
		}
	}
}

// podHolding is a pod whose index holds the given blocks and items, its streams trusted as given.
func podHolding(kvLive, mmLive bool, blocks, items []string) *pod {
	idx := events.NewIndex()
	idx.ApplyKV([]events.Event{{Kind: events.BlockStored, Blocks: blocks}})
	for _, it := range items {
		idx.ApplyMM([]events.Event{{Kind: events.ItemStored, Item: it}})
	}
	return &pod{index: idx, kv: fixed(kvLive), mm: fixed(mmLive)}
}

func TestAScoreWeighsThePrefixAndTheImages(t *testing.T) {
	req := &requestKeys{blocks: []string{"b0", "b1", "b2", "b3"}, items: []string{"i0", "i1"}}
	for _, c := range []struct {
		name          string
		blocks, items []string
		keys          *requestKeys
		want          float64
	}{
		{"all held", []string{"b0", "b1", "b2", "b3"}, []string{"i0", "i1"}, req, 1},
		{"3/4 of the prefix, both images", []string{"b0", "b1", "b2"}, []string{"i0", "i1"}, req, kvWeight*0.75 + mmWeight},
		{"a gap ends the prefix", []string{"b0", "b2", "b3"}, []string{"i1"}, req, kvWeight*0.25 + mmWeight*0.5},
		{"nothing", nil, nil, req, 0},
		{"text only: the prefix is all", []string{"b0", "b1"}, nil,
			&requestKeys{blocks: req.blocks}, 0.5},
		{"images only: the images are all", nil, []string{"i0"},
			&requestKeys{items: req.items}, 0.5},
		{"no keys", []string{"b0"}, []string{"i0"}, &requestKeys{}, 0},
	} {
		if got := podHolding(true, true, c.blocks, c.items).score(c.keys); !near(got, c.want) {
			t.Errorf("%s: score %v, want %v", c.name, got, c.want)
		}
	}
}

// Trust gating: a stream not Live contributes nothing, but its part of the request still
// counts in the denominator (the pod is not believed to hold it).
func TestAnUntrustedStreamContributesNothing(t *testing.T) {
	req := &requestKeys{blocks: []string{"b0", "b1"}, items: []string{"i0"}}
	all := func(kv, mm bool) float64 {
		return podHolding(kv, mm, []string{"b0", "b1"}, []string{"i0"}).score(req)
	}
	for _, c := range []struct {
		kv, mm bool
		want   float64
	}{{true, true, 1}, {false, true, mmWeight}, {true, false, kvWeight}, {false, false, 0}} {
		if got := all(c.kv, c.mm); !near(got, c.want) {
			t.Errorf("kv live %v, mm live %v: score %v, want %v", c.kv, c.mm, got, c.want)
		}
	}
}
