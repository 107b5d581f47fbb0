package ratelimitredis

import (
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/usage"
)

// The JSON document of the hostile bodies below: a string of padding between head and tail,
// the usage (7 tokens) at the end, where a decoder that reads everything finds it.
const (
	bombHead = `{"id":"x","pad":"`
	bombTail = `","usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}`
)

// gzipMember returns one gzip member (RFC 1952) of prefix, n bytes of 'a', then suffix, at the
// best compression: 8 MiB of 'a' take about 8 kB.
func gzipMember(prefix string, n int, suffix string) []byte {
	var b bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&b, gzip.BestCompression) // a valid level; a Buffer never fails
	_, _ = io.WriteString(zw, prefix)
	_, _ = zw.Write(bytes.Repeat([]byte("a"), n))
	_, _ = io.WriteString(zw, suffix)
	_ = zw.Close()
	return b.Bytes()
}

// gzipBombParts are the members of a gzip body of about 10 GiB decoded: a first member with
// the JSON's head, 1278 of padding and a last with the usage, each of 8 MiB of 'a' (built
// once: they are the same in every run).
var gzipBombParts = sync.OnceValue(func() (p struct{ head, mid, tail []byte }) {
	p.head = gzipMember(bombHead, 8<<20, "")
	p.mid = gzipMember("", 8<<20, "")
	p.tail = gzipMember("", 8<<20, bombTail)
	return p
})

// gzipBombMembers is how many members the gzip bomb has: 1280 × 8 MiB, 10 GiB decoded.
const gzipBombMembers = 1280

// TestChargeDecodingBounded: an upstream answers a charge openai_usage zone with a gzip body of
// 10 MB that inflates to 10 GiB, its usage at the end (generated as it is sent: 1280 gzip members
// of 8 MiB of 'a'). The zone stops decoding once the body inflates more than 100 times the
// bytes received (past 8 MiB), so Caddy decodes megabytes, not gigabytes; the client still
// receives every byte the upstream sent, unchanged (their SHA-256); the request is charged the
// zone's missing amount (the capacity, 100000: what the undecoded rest reports is unknown), not
// the 7 at the end; and the stop is counted in charge_undecoded_total{reason="ratio"}.
func TestChargeDecodingBounded(t *testing.T) {
	srv := redistest.Start(t)
	parts := gzipBombParts()
	var sent hash.Hash
	var sentMu sync.Mutex
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := sha256.New()
		out := io.MultiWriter(w, h)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Encoding", "gzip")
		w.Header().Set("Content-Length", fmt.Sprint(len(parts.head)+(gzipBombMembers-2)*len(parts.mid)+len(parts.tail)))
		_, _ = out.Write(parts.head)
		for range gzipBombMembers - 2 {
			if _, err := out.Write(parts.mid); err != nil {
				return
			}
		}
		_, _ = out.Write(parts.tail)
		sentMu.Lock()
		sent = h
		sentMu.Unlock()
	}))
	t.Cleanup(up.Close)
	cs := startCaddy(t, openAIZone(srv.Addr, up.URL, "charge openai_usage total"))
	before := testutil.ToFloat64(metrics.chargeUndecoded.WithLabelValues("tokens", usage.StopRatio))

	req, _ := http.NewRequest(http.MethodGet, cs.base+"/v1/chat/completions", nil)
	req.Header.Set("Authorization", "bomb")
	req.Header.Set("Accept-Encoding", "gzip")
	tr := &http.Transport{DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	got := sha256.New()
	n, err := io.Copy(got, resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("%d, read %d bytes: %v", resp.StatusCode, n, err)
	}
	sentMu.Lock()
	want := sent
	sentMu.Unlock()
	if want == nil || !bytes.Equal(got.Sum(nil), want.Sum(nil)) {
		t.Fatalf("the client got %d bytes that are not the upstream's", n)
	}
	charged(t, srv, "a 10 GiB gzip bomb", "bomb", 100000)
	if d := testutil.ToFloat64(metrics.chargeUndecoded.WithLabelValues("tokens", usage.StopRatio)) - before; d != 1 {
		t.Fatalf("charge_undecoded_total{reason=ratio} grew by %v, want 1", d)
	}
}

// zstdFrameHeader is the header of a zstd frame (RFC 8878 section 3.1.1.1) asking for a window
// of 8 MiB (Window_Descriptor 13 << 3: 2^(10+13)), no content size, no checksum, no dictionary:
// the frame klauspost/compress's encoder writes by default.
var zstdFrameHeader = []byte{0x28, 0xb5, 0x2f, 0xfd, 0x00, 13 << 3}

// zstdRawBlock is a zstd block (RFC 8878 section 3.1.1.2) holding data as it is: its 3-byte
// header (Last_Block, Block_Type 0 (raw), Block_Size), then data.
func zstdRawBlock(data string, last bool) []byte {
	h := uint32(len(data)) << 3
	if last {
		h |= 1
	}
	var b [4]byte
	binary.LittleEndian.PutUint32(b[:], h)
	return append(b[:3], data...)
}

// TestChargeZstdWindowsBounded: 16 responses at once, each a zstd frame asking for an 8 MiB
// window (the default of klauspost/compress's encoder), are held open by the upstream after
// their first blocks. The windows of the responses decoded at once are at most 64 MiB, 8 such
// responses: the process's heap grows by less than 96 MiB, the windows and the decoders' buffers
// of about 1 MiB each (without a bound, 16 decoders take about 150 MiB), the 8 decoded are charged the usage their bodies end with (7), the 8 that found
// no room are charged the zone's missing amount (100000) and counted in
// charge_undecoded_total{reason="memory"}, and every client gets the upstream's bytes unchanged.
func TestChargeZstdWindowsBounded(t *testing.T) {
	const n = 16
	srv := redistest.Start(t)
	gate := make(chan struct{})
	blocks := [][]byte{
		append(append([]byte{}, zstdFrameHeader...), zstdRawBlock(bombHead, false)...),
		zstdRawBlock(strings.Repeat("a", 64<<10), false), // more than a read of the decoder's 4 kB buffer
		zstdRawBlock(strings.Repeat("b", 1000), false),
		zstdRawBlock(bombTail, true),
	}
	body := bytes.Join(blocks, nil)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Encoding", "zstd")
		rc := http.NewResponseController(w)
		for i, b := range blocks {
			if i == len(blocks)-1 {
				select {
				case <-gate:
				case <-r.Context().Done():
					return
				}
			}
			_, _ = w.Write(b)
			_ = rc.Flush()
		}
	}))
	t.Cleanup(up.Close)
	cs := startCaddy(t, openAIZone(srv.Addr, up.URL, "charge openai_usage total"))
	before := testutil.ToFloat64(metrics.chargeUndecoded.WithLabelValues("tokens", usage.StopMemory))
	heap := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapInuse
	}
	heapBefore := heap()

	type result struct {
		body []byte
		err  error
	}
	results := make([]chan result, n)
	started := make(chan error, n)
	tr := &http.Transport{DisableCompression: true, MaxConnsPerHost: n}
	t.Cleanup(tr.CloseIdleConnections)
	client := &http.Client{Transport: tr}
	for i := range n {
		results[i] = make(chan result, 1)
		go func() {
			req, _ := http.NewRequest(http.MethodGet, cs.base+"/v1/chat/completions", nil)
			req.Header.Set("Authorization", fmt.Sprintf("zw-%d", i))
			req.Header.Set("Accept-Encoding", "zstd")
			resp, err := client.Do(req)
			if err != nil {
				started <- err
				results[i] <- result{nil, err}
				return
			}
			defer resp.Body.Close()
			// The first three blocks: once the third reached the client, the zone's decoder has
			// taken the second (the writer writes to the client first, then to the decoder, one
			// write at a time, and the proxy flushes after each), and it reads a block's 64 kB
			// only once it has decoded the block before in its window, or found no room for the
			// window and stopped, which lets the write return at once.
			first := make([]byte, len(blocks[0])+len(blocks[1])+len(blocks[2]))
			_, err = io.ReadFull(resp.Body, first)
			started <- err
			rest, err2 := io.ReadAll(resp.Body)
			results[i] <- result{append(first, rest...), errors.Join(err, err2)}
		}()
	}
	for range n {
		if err := <-started; err != nil {
			close(gate)
			t.Fatal(err)
		}
	}
	grown := int64(heap()) - int64(heapBefore)
	close(gate)
	for i := range n {
		r := <-results[i]
		if r.err != nil || !bytes.Equal(r.body, body) {
			t.Fatalf("client %d: %v, %d bytes; want the upstream's %d", i, r.err, len(r.body), len(body))
		}
	}
	decoded, refused := 0, 0
	for i := range n {
		switch u := tokensUsed(t, srv, fmt.Sprintf("zw-%d", i)); { // less the refill while held
		case u > 5 && u <= 7:
			decoded++
		case u > 99998 && u <= 100000:
			refused++
		default:
			t.Fatalf("client %d charged %v, want 7 (decoded) or 100000 (missing)", i, u)
		}
	}
	t.Logf("%d held zstd responses with 8 MiB windows: the heap grew by %d MiB; %d decoded, %d refused", n, grown>>20, decoded, refused)
	if decoded != zstdWindowBudget/maxZstdWindow || refused != n-decoded {
		t.Fatalf("%d decoded and %d refused, want %d decoded (64 MiB of 8 MiB windows) and the rest refused", decoded, refused, zstdWindowBudget/maxZstdWindow)
	}
	if grown >= zstdWindowBudget*3/2 {
		t.Fatalf("the heap grew by %d MiB with %d responses held, want less than 96 (64 MiB of windows and their buffers)", grown>>20, n)
	}
	if d := testutil.ToFloat64(metrics.chargeUndecoded.WithLabelValues("tokens", usage.StopMemory)) - before; d != float64(refused) {
		t.Fatalf("charge_undecoded_total{reason=memory} grew by %v, want %d", d, refused)
	}
	// Every window was given back as its response ended: the next response is decoded.
	if r := cs.send("/v1/chat/completions", "zw-after", nil, "Accept-Encoding", "zstd"); r.status != 200 || !bytes.Equal(r.body, body) {
		t.Fatalf("the next response: %d, %d bytes", r.status, len(r.body))
	}
	charged(t, srv, "the next response", "zw-after", 7)
}

// The bounds of the zstd windows decoded at once (docs/charging.md): 8 MiB a window, 64 MiB for
// every response of the process.
const (
	maxZstdWindow    = 8 << 20
	zstdWindowBudget = 64 << 20
)
