//go:build tools

// Package tools pins cmd/jaeger so that `go mod tidy` keeps its dependencies in go.sum.
// It is never compiled.
package tools

import _ "github.com/jaegertracing/jaeger/cmd/jaeger"
