package ratelimitredis

import (
	"bufio"
	"errors"
	"io"
	"net/http"
	"strings"

	"github.com/klauspost/compress/flate"
	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zlib"
	"github.com/klauspost/compress/zstd"
)

// The content codings whose bodies the usage scanner reads, decoded as they pass (a body of any
// other coding reports no usage). Brotli is not among them: no brotli decoder is in Caddy's
// dependencies, so a zone that charges openai_usage asks the upstream for the others only
// (readableCodings).
var readableCodings = map[string]bool{"gzip": true, "x-gzip": true, "deflate": true, "zstd": true, "identity": true}

// maxZstdWindow bounds the window a zstd body may use, so the memory one response's decoding
// takes: 8 MB, the most RFC 8878 lets an HTTP zstd coding use (section 3.1.1.1.2).
const maxZstdWindow = 8 << 20

// errDecoded ends a decoder's pipe: writes after it return at once.
var errDecoded = errors.New("usage decoder done")

// usageDecoder decodes a compressed body on its way to a usage scanner: the bytes written to it
// go through a pipe to a goroutine that decodes them into the scanner. A Write returns once the
// goroutine has taken its bytes (it decodes what it took meanwhile), so memory stays bounded
// (the decoder's window and buffers); the response writer sends each chunk on to the client
// before writing it here, so decoding never holds a byte back. Once the decoder fails, or the
// body ends, writes return at once.
type usageDecoder struct {
	pw   *io.PipeWriter
	done chan struct{}
}

// newUsageDecoder starts decoding coding (one of readableCodings but identity) into dst.
func newUsageDecoder(coding string, dst io.Writer) *usageDecoder {
	pr, pw := io.Pipe()
	d := &usageDecoder{pw: pw, done: make(chan struct{})}
	go func() {
		defer close(d.done)
		_ = decodeInto(coding, pr, dst) // a body cut short or corrupt reports what it reported so far
		pr.CloseWithError(errDecoded)
	}()
	return d
}

// Write passes p to the decoder; it never fails.
func (d *usageDecoder) Write(p []byte) (int, error) {
	_, _ = d.pw.Write(p)
	return len(p), nil
}

// finish ends the body and waits until everything written has been decoded.
func (d *usageDecoder) finish() {
	_ = d.pw.Close()
	<-d.done
}

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
		zr, err := zstd.NewReader(r, zstd.WithDecoderConcurrency(1), zstd.WithDecoderLowmem(true), zstd.WithDecoderMaxWindow(maxZstdWindow))
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
