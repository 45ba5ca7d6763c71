package mmiscache

import (
	"github.com/prometheus/client_golang/prometheus"
	crmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"
)

// What the scorer knows of each followed pod, served on the picker's --metrics-port beside
// the framework's own metrics (one series per pod address and stream, read at scrape time).
var (
	blocksDesc = prometheus.NewDesc("mmis_picker_index_blocks",
		"Prefix-cache blocks the picker knows the pod's engine holds.", []string{"pod"}, nil)
	itemsDesc = prometheus.NewDesc("mmis_picker_index_items",
		"Multimodal items the picker knows the pod's engine holds.", []string{"pod"}, nil)
	liveDesc = prometheus.NewDesc("mmis_picker_stream_live",
		"1 while the pod's event stream is trusted (its replay socket answered within silenceSeconds).",
		[]string{"pod", "stream"}, nil)
)

type collector struct{ pods *pods }

func (c collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- blocksDesc
	ch <- itemsDesc
	ch <- liveDesc
}

func (c collector) Collect(ch chan<- prometheus.Metric) {
	c.pods.mu.Lock()
	defer c.pods.mu.Unlock()
	for addr, p := range c.pods.byAddr {
		blocks, items, _ := p.index.Sizes()
		ch <- prometheus.MustNewConstMetric(blocksDesc, prometheus.GaugeValue, float64(blocks), addr)
		ch <- prometheus.MustNewConstMetric(itemsDesc, prometheus.GaugeValue, float64(items), addr)
		for name, s := range map[string]interface{ Live() bool }{"kv": p.kv, "mm": p.mm} {
			v := 0.0
			if s.Live() {
				v = 1
			}
			ch <- prometheus.MustNewConstMetric(liveDesc, prometheus.GaugeValue, v, addr, name)
		}
	}
}

// register serves ps's figures from the picker's metrics endpoint (once per process: a second
// scorer instance's figures are not served).
func register(ps *pods) {
	_ = crmetrics.Registry.Register(collector{ps})
}
