package mmiscache

import (
	"encoding/json"
	"testing"
)

func payload(t *testing.T, s string) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal([]byte(s), &m); err != nil {
		t.Fatal(err)
	}
	return m
}

func TestImageAffinityFollowsTheImagesOnly(t *testing.T) {
	a := payload(t, `{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:a"}},{"type":"text","text":"one"}]}]}`)
	b := payload(t, `{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:a"}},{"type":"text","text":"two"}]}]}`)
	c := payload(t, `{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:c"}},{"type":"text","text":"one"}]}]}`)
	text := payload(t, `{"messages":[{"role":"user","content":"hello"}]}`)
	if imageAffinity(a) == 0 || imageAffinity(a) != imageAffinity(b) {
		t.Error("two questions about one image must ask the same front end")
	}
	if imageAffinity(a) == imageAffinity(c) {
		t.Error("different images hash differently")
	}
	if imageAffinity(text) != 0 {
		t.Error("a request without images has no affinity")
	}
}
