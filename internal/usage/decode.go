package usage

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

// The content codings whose bodies a Scanner can read, decoded as they pass by a Decoder (a body
// of any other coding reports no usage). Brotli is not among them: no brotli decoder is in
// Caddy's dependencies, so a request whose response is read asks the upstream for the others
// only (AcceptReadable).
var readableCodings = map[string]bool{"gzip": true, "x-gzip": true, "deflate": true, "zstd": true, "identity": true}

// maxZstdWindow bounds the window a zstd body may use, so the memory one response's decoding
// takes: 8 MB, the most RFC 8878 lets an HTTP zstd coding use (section 3.1.1.1.2).
const maxZstdWindow = 8 << 20

// zstdWindowBudget bounds the zstd windows of every response decoded at once in the process:
// a zstd decoder holds its window (about that much memory, allocated at the frame's start
// however short the body), up to maxZstdWindow, where gzip and deflate hold 32 KB. A body whose
// window does not fit in what is left is not decoded (StopMemory).
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

// Why decoding stopped before the body's end (Decoder.Finish).
const (
	StopSize   = "size"   // past maxDecodedBytes (256 MiB)
	StopRatio  = "ratio"  // past maxDecodeRatio (100) times the bytes received, plus decodeRatioFloor (8 MiB)
	StopMemory = "memory" // no room left in zstdWindowBudget (64 MiB) for the body's zstd window
)

// StopReasons are every reason decoding stops for, in a fixed order.
var StopReasons = [...]string{StopSize, StopRatio, StopMemory}

// errDecoded ends a decoder's pipe: writes after it return at once.
var errDecoded = errors.New("usage decoder done")

// errDecodeLimit ends decoding at one of its bounds.
var errDecodeLimit = errors.New("usage decoder: past its bounds")

// Decoder decodes a compressed body on its way to a Scanner: the bytes written to it go through
// a pipe to a goroutine that decodes them into the scanner. A Write returns once the
// goroutine has taken its bytes (it decodes what it took meanwhile), so memory stays bounded
// (the decoder's window and buffers); a response writer that sends each chunk on to the client
// before writing it here never has decoding hold a byte back. Once the decoder fails, the body
// ends, or decoding reaches one of its bounds, writes return at once: the rest of the body is
// not decoded. Call Finish once the body is complete. The bounds: a zstd window of at most
// maxZstdWindow (8 MiB), and at most zstdWindowBudget (64 MiB) of windows for every Decoder of
// the process at once; at most maxDecodedBytes (256 MiB) decoded, and at most decodeRatioFloor
// (8 MiB) plus maxDecodeRatio (100) times the bytes written so far.
type Decoder struct {
	pw       *io.PipeWriter
	done     chan struct{}
	received atomic.Int64 // bytes written, at least those the goroutine has read
	// stopped is why decoding stopped before the body's end (StopSize, StopRatio,
	// StopMemory), or ""; read after done is closed.
	stopped string
}

// NewDecoder starts decoding a body of coding (one that BodyCoding reports readable, but
// identity) into dst. A body cut short or corrupt has what was decoded of it so far written to
// dst.
func NewDecoder(coding string, dst io.Writer) *Decoder {
	pr, pw := io.Pipe()
	d := &Decoder{pw: pw, done: make(chan struct{})}
	go func() {
		defer close(d.done)
		lim := &decodeLimit{dst: dst, received: &d.received}
		err := decodeInto(coding, pr, lim) // a body cut short or corrupt reports what it reported so far
		switch {
		case lim.stopped != "":
			d.stopped = lim.stopped
		case errors.Is(err, errNoWindow):
			d.stopped = StopMemory
		}
		pr.CloseWithError(errDecoded)
	}()
	return d
}

// Write passes p to the decoder; it never fails.
func (d *Decoder) Write(p []byte) (int, error) {
	d.received.Add(int64(len(p)))
	_, _ = d.pw.Write(p)
	return len(p), nil
}

// Finish ends the body and waits until everything written has been decoded, or decoding has
// stopped; it returns why decoding stopped before the body's end (StopSize, StopRatio,
// StopMemory), or "" when it did not.
func (d *Decoder) Finish() string {
	_ = d.pw.Close()
	<-d.done
	return d.stopped
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
		l.stopped = StopSize
	case l.decoded > decodeRatioFloor+maxDecodeRatio*l.received.Load():
		l.stopped = StopRatio
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

// BodyCoding returns the content coding of a response body of header h, lower-cased ("identity"
// when none), and whether a Scanner can read it (through a Decoder unless identity): gzip,
// x-gzip, deflate (zlib or raw), zstd or identity, applied once.
func BodyCoding(h http.Header) (string, bool) {
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

// AcceptReadable rewrites the request header h's Accept-Encoding to list only the codings
// BodyCoding reports readable, so that the upstream answers in one of them: the client still
// gets one it accepts (identity when none is left). Without the field the request is left alone
// (most upstreams then answer identity; Caddy's reverse_proxy asks for gzip and decodes it
// itself).
func AcceptReadable(h http.Header) {
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
