// Package mmiscache is the endpoint picker's "mmis-cache-scorer" (docs/ROUTING.md): it scores
// each candidate pod by how much of a request its engine already holds, from the engine's own
// cache events.
//
// A request walked through it:
//  1. Score gets the candidates. Each pod's two event streams are followed from the first
//     time it is a candidate (pods.go; the streams are events.Stream).
//  2. It asks one pod's front end for the request's keys: POST /internal/block_keys on the
//     operations port answers the prompt's block keys and its images' mm_hashes, computed by
//     the same code P1 keys its caches with (keys.go).
//  3. A pod scores kvWeight * (cached prefix blocks / blocks) + mmWeight * (images held /
//     images), over the streams it can trust (events.Index, events.Stream.Live).
//
// Invariants: a request never fails here. No keys (timeout, non-chat request, bad answer), or
// no trusted stream, gives every pod 0: the profile's load scorers decide alone.
package mmiscache

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"time"

	"sigs.k8s.io/controller-runtime/pkg/log"
	fwkplugin "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/plugin"
	framework "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/scheduling"
)

// Type is the plugin type named in the picker's configuration.
const Type = "mmis-cache-scorer"

// TokenEnv names the environment variable holding the internal token (docs/SECURITY.md):
// the PLAIN password on the engines' event sockets and the bearer token of
// /internal/block_keys. Never a parameter: the configuration is not a secret.
const TokenEnv = "MMIS_INTERNAL_TOKEN"

const (
	kvWeight = 0.7
	mmWeight = 0.3
)

// Params are the plugin's parameters (operator/mmis_operator/routing.py writes them).
type Params struct {
	KVEventsPort   int     `json:"kvEventsPort"`
	KVReplayPort   int     `json:"kvReplayPort"`
	MMEventsPort   int     `json:"mmEventsPort"`
	MMReplayPort   int     `json:"mmReplayPort"`
	KeysPort       int     `json:"keysPort"`
	KeysTimeoutMs  int     `json:"keysTimeoutMs"`
	SilenceSeconds float64 `json:"silenceSeconds"`
}

func defaultParams() Params {
	return Params{
		KVEventsPort: 5557, KVReplayPort: 5558, MMEventsPort: 5559, MMReplayPort: 5560,
		KeysPort: 8001, KeysTimeoutMs: 300, SilenceSeconds: 10,
	}
}

var _ framework.Scorer = &Scorer{}

// Scorer scores candidates by the request's cached prefix and images on each.
type Scorer struct {
	typedName fwkplugin.TypedName
	params    Params
	pods      *pods
	keys      *keysClient
}

// Factory builds the scorer from its configuration entry.
func Factory(name string, raw json.RawMessage, handle fwkplugin.Handle) (fwkplugin.Plugin, error) {
	p := defaultParams()
	if len(raw) > 0 {
		if err := json.Unmarshal(raw, &p); err != nil {
			return nil, fmt.Errorf("%s parameters: %w", Type, err)
		}
	}
	for _, port := range []int{p.KVEventsPort, p.KVReplayPort, p.MMEventsPort, p.MMReplayPort, p.KeysPort} {
		if port <= 0 || port > 65535 {
			return nil, fmt.Errorf("%s parameters: port %d out of range", Type, port)
		}
	}
	if p.KeysTimeoutMs <= 0 || p.SilenceSeconds <= 0 {
		return nil, fmt.Errorf("%s parameters: keysTimeoutMs and silenceSeconds must be positive", Type)
	}
	ctx := context.Background()
	if handle != nil {
		ctx = handle.Context()
	}
	return New(ctx, name, p), nil
}

// New returns a scorer whose event subscriptions live until ctx ends; it presents the
// internal token from TokenEnv when that is set.
func New(ctx context.Context, name string, p Params) *Scorer {
	return newScorer(ctx, name, p, os.Getenv(TokenEnv))
}

func newScorer(ctx context.Context, name string, p Params, token string) *Scorer {
	if name == "" {
		name = Type
	}
	logger := log.FromContext(ctx).WithName(Type)
	if token == "" {
		logger.Info(TokenEnv + " is not set: event sockets without credentials (NULL), " +
			"/internal/block_keys without a token")
	}
	ps := newPods(ctx, p, token, logger)
	register(ps)
	return &Scorer{
		typedName: fwkplugin.TypedName{Type: Type, Name: name},
		params:    p,
		pods:      ps,
		keys:      newKeysClient(p.KeysPort, time.Duration(p.KeysTimeoutMs)*time.Millisecond, token),
	}
}

// TypedName returns the type and name of this plugin instance.
func (s *Scorer) TypedName() fwkplugin.TypedName { return s.typedName }

// Category: the scorer prefers the pods that hold a request's data.
func (s *Scorer) Category() framework.ScorerCategory { return framework.Affinity }

// Score gives each endpoint a value in [0, 1]; see the package comment.
func (s *Scorer) Score(ctx context.Context, _ *framework.CycleState, req *framework.LLMRequest,
	endpoints []framework.Endpoint) map[framework.Endpoint]float64 {
	logger := log.FromContext(ctx).WithName(Type)
	scores := make(map[framework.Endpoint]float64, len(endpoints))
	held := make([]*pod, len(endpoints))
	var addrs []string
	for i, ep := range endpoints {
		scores[ep] = 0
		addr := ep.GetMetadata().GetIPAddress()
		held[i] = s.pods.get(addr)
		addrs = append(addrs, addr)
	}
	body, affinity := chatBody(req)
	if body == nil {
		return scores
	}
	keys, err := s.keys.fetch(ctx, addrs, body, affinity)
	if err != nil {
		logger.V(1).Info("no block keys; scoring by load alone", "err", err.Error())
		return scores
	}
	for i, ep := range endpoints {
		scores[ep] = held[i].score(keys)
	}
	logger.V(1).Info("scored", "blocks", len(keys.blocks), "images", len(keys.items), "scores", describe(scores))
	return scores
}

// chatBody is a chat request's body to ask keys for, and its images' affinity (keys.go).
func chatBody(req *framework.LLMRequest) ([]byte, uint64) {
	if req == nil || req.Body == nil || req.Body.ChatCompletions == nil {
		return nil, 0
	}
	payload, ok := req.Body.Payload.(framework.PayloadMap)
	if !ok {
		return nil, 0
	}
	body, err := json.Marshal(map[string]any(payload))
	if err != nil {
		return nil, 0
	}
	return body, imageAffinity(payload)
}

func describe(scores map[framework.Endpoint]float64) map[string]float64 {
	out := make(map[string]float64, len(scores))
	for ep, v := range scores {
		out[ep.GetMetadata().GetIPAddress()] = v
	}
	return out
}
