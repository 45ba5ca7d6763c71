// mmis-gateway: the gateway's side of the endpoint picker's ext_proc protocol, for tests and
// benchmarks where Envoy cannot be installed (docs/ROUTING.md). It is not a production proxy.
//
// For each HTTP request it does what Envoy's ext_proc filter does with the picker in
// FULL_DUPLEX_STREAMED mode: sends the request headers and body, reads the header mutation
// naming the destination (x-gateway-destination-endpoint) and the body the picker returns,
// forwards that body to the destination, then streams the response's headers and body
// through the picker and writes back what the picker returns, chunk by chunk (so a streamed
// answer stays streamed). The chosen endpoint is also returned to the client in the
// x-gateway-destination-endpoint response header, so a test can see where a request went.
//
// Invariant: an answer the picker refuses (an ImmediateResponse) is returned as the picker
// wrote it; a picker that cannot be reached gives 503.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"strconv"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/google/uuid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

const destinationHeader = "x-gateway-destination-endpoint"

type gateway struct {
	picker  extproc.ExternalProcessorClient
	backend *http.Client
}

func main() {
	listen := flag.String("listen", "127.0.0.1:8080", "address to serve HTTP on")
	picker := flag.String("picker", "127.0.0.1:9002", "the endpoint picker's ext_proc gRPC address")
	flag.Parse()
	conn, err := grpc.NewClient(*picker, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatalf("mmis-gateway: picker %s: %v", *picker, err)
	}
	g := &gateway{picker: extproc.NewExternalProcessorClient(conn), backend: &http.Client{}}
	srv := &http.Server{Addr: *listen, Handler: g, ReadHeaderTimeout: 10 * time.Second}
	log.Printf("mmis-gateway listening on http://%s, picker %s", *listen, *picker)
	log.Fatal(srv.ListenAndServe())
}

func header(k, v string) *corev3.HeaderValue {
	return &corev3.HeaderValue{Key: k, RawValue: []byte(v)}
}

func (g *gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, "cannot read the request body", http.StatusBadRequest)
		return
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	stream, err := g.picker.Process(ctx)
	if err != nil {
		http.Error(w, "endpoint picker unreachable: "+err.Error(), http.StatusServiceUnavailable)
		return
	}
	dest, fwdBody, immediate, err := g.pick(stream, r, body)
	if err != nil {
		http.Error(w, "endpoint picker: "+err.Error(), http.StatusServiceUnavailable)
		return
	}
	if immediate != nil {
		code := int(immediate.GetStatus().GetCode())
		if code == 0 {
			code = http.StatusInternalServerError
		}
		w.WriteHeader(code)
		_, _ = w.Write(immediate.GetBody())
		return
	}
	g.forward(ctx, w, r, stream, dest, fwdBody)
}

// pick sends the request through the picker and returns the destination and the body to send.
func (g *gateway) pick(stream extproc.ExternalProcessor_ProcessClient, r *http.Request, body []byte) (
	string, []byte, *extproc.ImmediateResponse, error) {
	hs := []*corev3.HeaderValue{
		header(":method", r.Method), header(":path", r.URL.Path), header(":authority", r.Host),
		header(":scheme", "http"), header("x-request-id", uuid.NewString()),
	}
	for k, vs := range r.Header {
		if len(vs) > 0 {
			hs = append(hs, header(strings.ToLower(k), vs[0]))
		}
	}
	// io.EOF from Send: the picker ended the stream (after an ImmediateResponse, say); what it
	// sent, and why it ended, are read by Recv below
	if err := stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extproc.HttpHeaders{Headers: &corev3.HeaderMap{Headers: hs}}}}); err != nil && !errors.Is(err, io.EOF) {
		return "", nil, nil, err
	}
	if err := stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestBody{
		RequestBody: &extproc.HttpBody{Body: body, EndOfStream: true}}}); err != nil && !errors.Is(err, io.EOF) {
		return "", nil, nil, err
	}
	var dest string
	var out []byte
	for {
		resp, err := stream.Recv()
		if err != nil {
			return "", nil, nil, err
		}
		switch v := resp.Response.(type) {
		case *extproc.ProcessingResponse_ImmediateResponse:
			return "", nil, v.ImmediateResponse, nil
		case *extproc.ProcessingResponse_RequestHeaders:
			for _, h := range v.RequestHeaders.GetResponse().GetHeaderMutation().GetSetHeaders() {
				if h.GetHeader().GetKey() == destinationHeader {
					dest = strings.Split(string(h.GetHeader().GetRawValue()), ",")[0]
				}
			}
		case *extproc.ProcessingResponse_RequestBody:
			sr := v.RequestBody.GetResponse().GetBodyMutation().GetStreamedResponse()
			out = append(out, sr.GetBody()...)
			if sr.GetEndOfStream() {
				if dest == "" {
					return "", nil, nil, errors.New("no destination endpoint in the picker's answer")
				}
				return dest, out, nil, nil
			}
		}
	}
}

// forward sends the request to dest and the response back through the picker to the client.
func (g *gateway) forward(ctx context.Context, w http.ResponseWriter, r *http.Request,
	stream extproc.ExternalProcessor_ProcessClient, dest string, body []byte) {
	req, err := http.NewRequestWithContext(ctx, r.Method, "http://"+dest+r.URL.RequestURI(), strings.NewReader(string(body)))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	req.Header = r.Header.Clone()
	req.Header.Del("Content-Length")
	resp, err := g.backend.Do(req)
	if err != nil {
		http.Error(w, fmt.Sprintf("endpoint %s: %v", dest, err), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	rh := []*corev3.HeaderValue{header(":status", strconv.Itoa(resp.StatusCode))}
	for k, vs := range resp.Header {
		if len(vs) > 0 {
			rh = append(rh, header(strings.ToLower(k), vs[0]))
		}
	}
	_ = stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extproc.HttpHeaders{Headers: &corev3.HeaderMap{Headers: rh}}}})
	for k, vs := range resp.Header {
		if k != "Content-Length" {
			w.Header()[k] = vs
		}
	}
	w.Header().Set(destinationHeader, dest)
	w.WriteHeader(resp.StatusCode)
	flusher, _ := w.(http.Flusher)

	done := make(chan struct{})
	go func() { // what the picker returns is what the client gets
		defer close(done)
		for {
			pr, err := stream.Recv()
			if err != nil {
				return
			}
			if v, ok := pr.Response.(*extproc.ProcessingResponse_ResponseBody); ok {
				sr := v.ResponseBody.GetResponse().GetBodyMutation().GetStreamedResponse()
				_, _ = w.Write(sr.GetBody())
				if flusher != nil {
					flusher.Flush()
				}
				if sr.GetEndOfStream() {
					return
				}
			}
		}
	}()
	buf := make([]byte, 32<<10)
	for {
		n, rerr := resp.Body.Read(buf)
		if n > 0 {
			chunk := append([]byte(nil), buf[:n]...)
			_ = stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_ResponseBody{
				ResponseBody: &extproc.HttpBody{Body: chunk}}})
		}
		if rerr != nil {
			break
		}
	}
	_ = stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_ResponseBody{
		ResponseBody: &extproc.HttpBody{EndOfStream: true}}})
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		log.Printf("mmis-gateway: the picker did not end the response body from %s", dest)
	}
	_ = stream.CloseSend()
}
