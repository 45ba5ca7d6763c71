package main

import (
	"bytes"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// fakePicker answers ext_proc as the endpoint picker does in FULL_DUPLEX_STREAMED mode: a
// header mutation naming dest, the request body back (with a mark, so a test sees the
// picker's body was forwarded), and the response passed through upper-cased (so a test sees
// the client got what the picker returned). With immediate set it answers that at once and
// ends the stream (as a picker may; the gateway must still read the answer).
type fakePicker struct {
	extproc.UnimplementedExternalProcessorServer
	dest      string
	immediate *extproc.ImmediateResponse
	noDest    bool // answers without a destination
	mu        sync.Mutex
	headers   map[string]string // the request headers it was sent
}

func streamed(body []byte, end bool) *extproc.CommonResponse {
	return &extproc.CommonResponse{BodyMutation: &extproc.BodyMutation{Mutation: &extproc.BodyMutation_StreamedResponse{
		StreamedResponse: &extproc.StreamedBodyResponse{Body: body, EndOfStream: end}}}}
}

func (f *fakePicker) Process(s extproc.ExternalProcessor_ProcessServer) error {
	if f.immediate != nil { // before reading anything: the gateway's sends may meet a closed stream
		return s.Send(&extproc.ProcessingResponse{Response: &extproc.ProcessingResponse_ImmediateResponse{
			ImmediateResponse: f.immediate}})
	}
	for {
		req, err := s.Recv()
		if err != nil {
			return nil
		}
		var resp *extproc.ProcessingResponse
		switch v := req.Request.(type) {
		case *extproc.ProcessingRequest_RequestHeaders:
			f.mu.Lock()
			f.headers = map[string]string{}
			for _, h := range v.RequestHeaders.GetHeaders().GetHeaders() {
				f.headers[h.GetKey()] = string(h.GetRawValue())
			}
			f.mu.Unlock()
			set := []*corev3.HeaderValueOption{{
				Header: &corev3.HeaderValue{Key: destinationHeader, RawValue: []byte(f.dest)}}}
			if f.noDest {
				set = nil
			}
			resp = &extproc.ProcessingResponse{Response: &extproc.ProcessingResponse_RequestHeaders{
				RequestHeaders: &extproc.HeadersResponse{Response: &extproc.CommonResponse{
					HeaderMutation: &extproc.HeaderMutation{SetHeaders: set}}}}}
		case *extproc.ProcessingRequest_RequestBody:
			body := append(append([]byte{}, v.RequestBody.GetBody()...), " [picked]"...)
			resp = &extproc.ProcessingResponse{Response: &extproc.ProcessingResponse_RequestBody{
				RequestBody: &extproc.BodyResponse{Response: streamed(body, true)}}}
		case *extproc.ProcessingRequest_ResponseHeaders:
			resp = &extproc.ProcessingResponse{Response: &extproc.ProcessingResponse_ResponseHeaders{
				ResponseHeaders: &extproc.HeadersResponse{}}}
		case *extproc.ProcessingRequest_ResponseBody:
			body := bytes.ToUpper(v.ResponseBody.GetBody())
			resp = &extproc.ProcessingResponse{Response: &extproc.ProcessingResponse_ResponseBody{
				ResponseBody: &extproc.BodyResponse{Response: streamed(body, v.ResponseBody.GetEndOfStream())}}}
		}
		if err := s.Send(resp); err != nil {
			return nil
		}
	}
}

// gatewayTo serves the gateway with its picker at addr.
func gatewayTo(t *testing.T, addr string) *httptest.Server {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	srv := httptest.NewServer(&gateway{picker: extproc.NewExternalProcessorClient(conn), backend: &http.Client{}})
	t.Cleanup(srv.Close)
	return srv
}

func servePicker(t *testing.T, p *fakePicker) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer()
	extproc.RegisterExternalProcessorServer(s, p)
	go func() { _ = s.Serve(l) }()
	t.Cleanup(s.Stop)
	return l.Addr().String()
}

func TestTheGatewayForwardsWhereThePickerSays(t *testing.T) {
	var got []byte
	backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got, _ = io.ReadAll(r.Body)
		w.Header().Set("X-Backend", "yes")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte("answer from " + r.URL.Path))
	}))
	defer backend.Close()
	dest := strings.TrimPrefix(backend.URL, "http://")
	picker := &fakePicker{dest: dest}
	gw := gatewayTo(t, servePicker(t, picker))

	resp, err := http.Post(gw.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{"q": 1}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if string(got) != `{"q": 1} [picked]` {
		t.Errorf("the backend got %q, want the picker's body", got)
	}
	if resp.StatusCode != http.StatusCreated || resp.Header.Get("X-Backend") != "yes" {
		t.Errorf("status %d, headers %v: want the backend's", resp.StatusCode, resp.Header)
	}
	if string(body) != "ANSWER FROM /V1/CHAT/COMPLETIONS" {
		t.Errorf("the client got %q, want the body the picker returned", body)
	}
	if resp.Header.Get(destinationHeader) != dest {
		t.Errorf("%s = %q, want %q", destinationHeader, resp.Header.Get(destinationHeader), dest)
	}
	picker.mu.Lock()
	defer picker.mu.Unlock()
	if picker.headers[":path"] != "/v1/chat/completions" || picker.headers[":method"] != "POST" ||
		picker.headers["x-request-id"] == "" || picker.headers["content-type"] != "application/json" {
		t.Errorf("the picker was sent headers %v", picker.headers)
	}
}

func TestAnImmediateResponseIsReturnedAsThePickerWroteIt(t *testing.T) {
	picker := &fakePicker{immediate: &extproc.ImmediateResponse{
		Status: &typev3.HttpStatus{Code: typev3.StatusCode_TooManyRequests}, Body: []byte("slow down")}}
	gw := gatewayTo(t, servePicker(t, picker))
	resp, err := http.Post(gw.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusTooManyRequests || string(body) != "slow down" {
		t.Errorf("got %d %q, want 429 \"slow down\"", resp.StatusCode, body)
	}
}

func TestAPickerThatNamesNoDestinationIs503(t *testing.T) {
	gw := gatewayTo(t, servePicker(t, &fakePicker{noDest: true}))
	resp, err := http.Post(gw.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), "no destination") {
		t.Errorf("got %d %q, want 503 saying there was no destination", resp.StatusCode, body)
	}
}

func TestAPickerThatCannotBeReachedIs503(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close() // nobody listens there now
	gw := gatewayTo(t, addr)
	resp, err := http.Post(gw.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("status %d, want 503", resp.StatusCode)
	}
}
