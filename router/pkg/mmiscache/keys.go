package mmiscache

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"mmis.dev/router/pkg/events"
)

// requestKeys is one request's cache keys, as P0 computes them.
type requestKeys struct {
	blocks []string // index keys of the prompt's full blocks, in order
	items  []string // the images' mm_hashes
}

// keysClient asks a front end for a request's keys (POST /internal/block_keys on its
// operations port: server/mmis/frontend/api/api_server.py).
//
// Invariants: one fetch spends at most timeout in all, trying the candidates in turn. A
// request with images starts at the front end its images hash to (over the sorted
// addresses), so repeats of one image ask the front end that already knows its placeholder
// length and runs no processor (server/mmis/frontend/client/renderer.py); other requests
// start at a rotating one, so no single front end carries every lookup. With the internal
// token (docs/SECURITY.md) every ask carries `Authorization: Bearer <token>`; without one,
// none (a front end without a token refuses /internal/*, so keys are missing and load decides).
type keysClient struct {
	port    int
	timeout time.Duration
	token   string
	http    *http.Client
	turn    atomic.Uint64
}

func newKeysClient(port int, timeout time.Duration, token string) *keysClient {
	return &keysClient{port: port, timeout: timeout, token: token, http: &http.Client{}}
}

type blockKeysAnswer struct {
	BlockSize int      `json:"block_size"`
	BlockKeys []string `json:"block_keys"`
	MMHashes  []string `json:"mm_hashes"`
}

func (c *keysClient) fetch(ctx context.Context, addrs []string, body []byte, affinity uint64) (*requestKeys, error) {
	if len(addrs) == 0 {
		return nil, errors.New("no candidates")
	}
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	addrs = slices.Sorted(slices.Values(addrs))
	start := int(c.turn.Add(1) % uint64(len(addrs)))
	if affinity != 0 {
		start = int(affinity % uint64(len(addrs)))
	}
	var errs []error
	for i := range addrs {
		addr := addrs[(start+i)%len(addrs)]
		k, err := c.fetchFrom(ctx, addr, body)
		if err == nil {
			return k, nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", addr, err))
		if ctx.Err() != nil {
			break
		}
	}
	return nil, errors.Join(errs...)
}

func (c *keysClient) fetchFrom(ctx context.Context, addr string, body []byte) (*requestKeys, error) {
	url := "http://" + net.JoinHostPort(addr, strconv.Itoa(c.port)) + "/internal/block_keys"
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("status %d: %.200s", resp.StatusCode, raw)
	}
	var ans blockKeysAnswer
	if err := json.Unmarshal(raw, &ans); err != nil {
		return nil, fmt.Errorf("answer is not block keys: %w", err)
	}
	k := &requestKeys{blocks: make([]string, 0, len(ans.BlockKeys)), items: ans.MMHashes}
	for _, h := range ans.BlockKeys {
		key, err := events.HexKey(h)
		if err != nil {
			return nil, err
		}
		k.blocks = append(k.blocks, key)
	}
	return k, nil
}

// imageAffinity hashes a chat request's image URLs (0: no image): equal images, equal hash.
func imageAffinity(payload map[string]any) uint64 {
	h := fnv.New64a()
	found := false
	messages, _ := payload["messages"].([]any)
	for _, m := range messages {
		msg, _ := m.(map[string]any)
		parts, _ := msg["content"].([]any)
		for _, p := range parts {
			part, _ := p.(map[string]any)
			image, _ := part["image_url"].(map[string]any)
			if url, ok := image["url"].(string); ok {
				_, _ = h.Write([]byte(url))
				found = true
			}
		}
	}
	if !found {
		return 0
	}
	return h.Sum64() | 1
}
