package ratelimitredis

import (
	"bufio"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync/atomic"

	"github.com/klauspost/compress/flate"
	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zlib"
	"github.com/klauspost/compress/zstd"
	"golang.org/x/sync/semaphore"
)

// The content codings whose bodies the usage scanner reads, decoded as they pass (a body of any
// other coding reports no usage). Brotli is not among them: no brotli decoder is in Caddy's
// dependencies, so a zone that charges openai_usage asks the upstream for the others only
// (readableCodings).
var readableCodings = map[string]bool{"gzip": true, "x-gzip": true, "deflate": true, "zstd": true, "identity": true}

// maxZstdWindow bounds the window a zstd body may use, so the memory one response's decoding
// takes: 8 MB, the most RFC 8878 lets an HTTP zstd coding use (section 3.1.1.1.2).
const maxZstdWindow = 8 << 20

// zstdWindowBudget bounds the zstd windows of every response decoded at once in the process:
// a zstd decoder holds its window (about that much memory, allocated at the frame's start
// however short the body), up to maxZstdWindow, where gzip and deflate hold 32 KB. A body whose
// window does not fit in what is left is not decoded (decodeMemory).
const zstdWindowBudget = 64 << 20

// zstdWindows is what is left of zstdWindowBudget, in bytes of window.
var zstdWindows = semaphore.NewWeighted(zstdWindowBudget)

// The bounds of what one response's decoding may cost in CPU (decoding runs at about 1 ns
// per decoded byte): at most maxDecodedBytes in all, and at most decodeRatioFloor plus
// maxDecodeRatio times the bytes received so far. JSON compresses about 3 to 20 times, an
// event stream flushed event by event less; a body that inflates more is a bomb, not a
// completion (Apache POI refuses a zip that inflates more than 100 times, for the same
// reason).
const (
	maxDecodedBytes  = 256 << 20
	decodeRatioFloor = 8 << 20
	maxDecodeRatio   = 100
)

// Why decoding stopped before the body's end: the reason label of
// charge_undecoded_total.
const (
	decodeSize   = "size"   // past maxDecodedBytes
	decodeRatio  = "ratio"  // past maxDecodeRatio times the bytes received (beyond decodeRatioFloor)
	decodeMemory = "memory" // no room left in zstdWindowBudget for the body's window
)

// decodeReasons are the reason label's values of charge_undecoded_total.
var decodeReasons = [...]string{decodeSize, decodeRatio, decodeMemory}

// errDecoded ends a decoder's pipe: writes after it return at once.
var errDecoded = errors.New("usage decoder done")

// errDecodeLimit ends decoding at one of its bounds.
var errDecodeLimit = errors.New("usage decoder: past its bounds")

// usageDecoder decodes a compressed body on its way to a usage scanner: the bytes written to it
// go through a pipe to a goroutine that decodes them into the scanner. A Write returns once the
// goroutine has taken its bytes (it decodes what it took meanwhile), so memory stays bounded
// (the decoder's window and buffers); the response writer sends each chunk on to the client
// before writing it here, so decoding never holds a byte back. Once the decoder fails, the body
// ends, or decoding reaches one of its bounds, writes return at once: the rest of the body goes
// to the client undecoded.
type usageDecoder struct {
	pw       *io.PipeWriter
	done     chan struct{}
	received atomic.Int64 // bytes written, at least those the goroutine has read
	// stopped is why decoding stopped before the body's end (decodeSize, decodeRatio,
	// decodeMemory), or ""; read after finish.
	stopped string
}

// newUsageDecoder starts decoding coding (one of readableCodings but identity) into dst.
func newUsageDecoder(coding string, dst io.Writer) *usageDecoder {
	pr, pw := io.Pipe()
	d := &usageDecoder{pw: pw, done: make(chan struct{})}
	go func() {
		defer close(d.done)
		lim := &decodeLimit{dst: dst, received: &d.received}
		err := decodeInto(coding, pr, lim) // a body cut short or corrupt reports what it reported so far
		switch {
		case lim.stopped != "":
			d.stopped = lim.stopped
		case errors.Is(err, errNoWindow):
			d.stopped = decodeMemory
		}
		pr.CloseWithError(errDecoded)
	}()
	return d
}

// Write passes p to the decoder; it never fails.
func (d *usageDecoder) Write(p []byte) (int, error) {
	d.received.Add(int64(len(p)))
	_, _ = d.pw.Write(p)
	return len(p), nil
}

// finish ends the body and waits until everything written has been decoded, or decoding has
// stopped.
func (d *usageDecoder) finish() {
	_ = d.pw.Close()
	<-d.done
}

// decodeLimit passes decoded bytes on to dst until they pass one of the bounds of decoding
// (maxDecodedBytes, maxDecodeRatio), then fails with errDecodeLimit, stopped saying which.
type decodeLimit struct {
	dst      io.Writer
	received *atomic.Int64
	decoded  int64
	stopped  string
}

func (l *decodeLimit) Write(p []byte) (int, error) {
	l.decoded += int64(len(p))
	switch {
	case l.decoded > maxDecodedBytes:
		l.stopped = decodeSize
	case l.decoded > decodeRatioFloor+maxDecodeRatio*l.received.Load():
		l.stopped = decodeRatio
	default:
		return l.dst.Write(p)
	}
	return 0, errDecodeLimit
}

// errNoWindow: the window of a zstd body does not fit in what is left of zstdWindowBudget.
var errNoWindow = errors.New("usage decoder: no room for the zstd window")

// decodeInto decodes r, a body of coding, into dst.
func decodeInto(coding string, r io.Reader, dst io.Writer) error {
	var dec io.Reader
	switch coding {
	case "gzip", "x-gzip":
		zr, err := gzip.NewReader(r)
		if err != nil {
			return err
		}
		defer zr.Close()
		dec = zr
	case "deflate":
		// RFC 9110's deflate is zlib (RFC 1950); some servers send raw deflate (RFC 1951).
		br := bufio.NewReader(r)
		h, err := br.Peek(2)
		if err != nil {
			return err
		}
		if h[0]&0x0f == 8 && (uint16(h[0])<<8|uint16(h[1]))%31 == 0 {
			zr, err := zlib.NewReader(br)
			if err != nil {
				return err
			}
			defer zr.Close()
			dec = zr
		} else {
			fr := flate.NewReader(br)
			defer fr.Close()
			dec = fr
		}
	case "zstd":
		br := bufio.NewReader(r)
		window, err := zstdWindow(br)
		if err != nil {
			return err
		}
		if !zstdWindows.TryAcquire(window) {
			return errNoWindow
		}
		defer zstdWindows.Release(window)
		// Every frame of the body is held to the first one's window: what was taken.
		zr, err := zstd.NewReader(br, zstd.WithDecoderConcurrency(1), zstd.WithDecoderLowmem(true), zstd.WithDecoderMaxWindow(uint64(window)))
		if err != nil {
			return err
		}
		defer zr.Close()
		dec = zr
	default:
		return errors.New("no decoder for content coding " + coding)
	}
	_, err := io.Copy(dst, dec)
	return err
}

// zstdWindow returns the window the zstd body of br asks for, read from its first frame's
// header (RFC 8878 section 3.1.1.1): its Window_Descriptor, or the content size of a single
// segment frame; maxZstdWindow when the first frame is a skippable one. An error when the
// header is not a zstd frame's, or asks for more than maxZstdWindow.
func zstdWindow(br *bufio.Reader) (int64, error) {
	b, _ := br.Peek(zstd.HeaderMaxSize) // a shorter body: its header may still be whole
	var h zstd.Header
	if err := h.Decode(b); err != nil {
		return 0, err
	}
	window := uint64(maxZstdWindow)
	switch {
	case h.Skippable:
	case h.SingleSegment:
		window = max(h.FrameContentSize, zstd.MinWindowSize)
	default:
		window = h.WindowSize
	}
	if window > maxZstdWindow {
		return 0, zstd.ErrWindowSizeExceeded
	}
	return int64(window), nil
}

// bodyCoding returns the content coding of a response body of header h, lower-cased ("identity"
// when none), and whether the usage scanner reads it.
func bodyCoding(h http.Header) (string, bool) {
	ce := h.Values("Content-Encoding")
	switch {
	case len(ce) == 0:
		return "identity", true
	case len(ce) > 1 || strings.Contains(ce[0], ","):
		return strings.Join(ce, ", "), false // codings applied one over another: not read
	}
	c := strings.ToLower(strings.TrimSpace(ce[0]))
	if c == "" {
		return "identity", true
	}
	return c, readableCodings[c]
}

// acceptReadable rewrites the request's Accept-Encoding to list only the codings the usage
// scanner reads, so that the upstream answers in one of them: the client still gets one it
// accepts (identity when none is left). Without the field the request is left alone (most
// upstreams then answer identity; Caddy's reverse_proxy asks for gzip and decodes it itself).
func acceptReadable(h http.Header) {
	v := h.Values("Accept-Encoding")
	if len(v) == 0 {
		return
	}
	var keep []string
	changed := false
	for _, f := range v {
		for part := range strings.SplitSeq(f, ",") {
			coding, _, _ := strings.Cut(part, ";")
			coding = strings.ToLower(strings.TrimSpace(coding))
			if coding == "" {
				continue
			}
			if !readableCodings[coding] {
				changed = true // br, compress, *, ...
				continue
			}
			keep = append(keep, strings.TrimSpace(part))
		}
	}
	if !changed {
		return
	}
	if len(keep) == 0 {
		keep = []string{"identity"}
	}
	h.Set("Accept-Encoding", strings.Join(keep, ", "))
}
