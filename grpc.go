package ratelimitredis

import (
	"net/http"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// gRPC clients read the status of a call from grpc-status, not from the HTTP status: a 429
// reaches a gRPC application as UNAVAILABLE (the HTTP-to-gRPC mapping of gRPC's
// doc/http-grpc-status-mapping.md), which many clients retry at once, or as a transport error.
// So a gRPC request (isGRPC) that is refused gets gRPC's Trailers-Only response
// (doc/PROTOCOL-HTTP2.md): HTTP 200, content-type application/grpc, and the status in the
// headers, with no body, which Go's HTTP/2 server sends as one HEADERS frame with END_STREAM
// (the handler writes nothing and does not flush).

// The grpc-status codes of a refusal (google.golang.org/grpc/codes).
const (
	grpcInvalidArgument   = "3"  // a bad cost: the 400
	grpcPermissionDenied  = "7"  // empty_key deny: the 403
	grpcResourceExhausted = "8"  // a denial: the RESOURCE_EXHAUSTED of Envoy's rate limit filter
	grpcInternal          = "13" // a zone number or matcher that cannot be used: the 500
	grpcUnavailable       = "14" // fail_mode closed: the limiter cannot decide
)

// grpcNoRetry is grpc-retry-pushback-ms asking the client not to retry at all: gRPC's retry
// design (gRFC A6) reads a negative pushback so, and grpc-go does (stream.go, shouldRetry).
const grpcNoRetry = "-1"

var (
	hdrCacheControl = http.CanonicalHeaderKey("Cache-Control")
	hdrContentType  = http.CanonicalHeaderKey("Content-Type")
	hdrGRPCStatus   = http.CanonicalHeaderKey("Grpc-Status")
	hdrGRPCMessage  = http.CanonicalHeaderKey("Grpc-Message")
	hdrGRPCPushback = http.CanonicalHeaderKey("Grpc-Retry-Pushback-Ms")
)

// isGRPC reports whether r is a gRPC call: a POST (every gRPC call is one) over HTTP/2 or later
// (gRPC has no HTTP/1.1 form) with a content-type of application/grpc, alone or followed by + (a
// subtype, +proto) or ; (a parameter), as PROTOCOL-HTTP2.md writes it. gRPC-Web
// (application/grpc-web) is not: its clients read a different framing. TE: trailers, which
// gRPC clients send, is not required: gRPC servers do not require it either, and a proxy in
// front of Caddy may drop it.
func isGRPC(r *http.Request) bool {
	if r.ProtoMajor < 2 || r.Method != http.MethodPost {
		return false
	}
	ct := r.Header[hdrContentType]
	if len(ct) == 0 || len(ct[0]) < len("application/grpc") ||
		!strings.EqualFold(ct[0][:len("application/grpc")], "application/grpc") {
		return false
	}
	rest := ct[0][len("application/grpc"):]
	return rest == "" || rest[0] == '+' || rest[0] == ';'
}

// noStore marks a refusal Cache-Control: no-store (RFC 9111 section 5.2.2.5): it answers this
// request at this moment, and no cache may give it to another request. A gRPC refusal is a 200,
// which caches may store without being told (heuristic freshness, RFC 9111 section 4.2.2).
func noStore(w http.ResponseWriter) {
	w.Header()[hdrCacheControl] = []string{"no-store"}
}

// grpcCall reports whether r is a gRPC call (isGRPC) that a refusal answers with a gRPC status:
// grpc_status is on.
func (h *Handler) grpcCall(r *http.Request) bool {
	return h.grpcStatus && isGRPC(r)
}

// refuse answers a request the handler refuses before any decision with status and err, through
// Caddy's error path (handle_errors shapes it), or, a gRPC call, with grpc-status code and
// grpc-message msg; either is Cache-Control: no-store.
func (h *Handler) refuse(w http.ResponseWriter, r *http.Request, status int, err error, code, msg string) error {
	noStore(w)
	if h.grpcCall(r) {
		writeGRPCRefusal(w, code, msg, "")
		return nil
	}
	return caddyhttp.Error(status, err)
}

// writeGRPCRefusal writes the Trailers-Only response of a refused gRPC call: HTTP 200 and
// content-type application/grpc, with grpc-status code, grpc-message msg (percent-encoded) and,
// unless pushback is "", grpc-retry-pushback-ms pushback (milliseconds, or grpcNoRetry). The
// headers set before (rate limit headers, Retry-After) go with it, as metadata to the client.
func writeGRPCRefusal(w http.ResponseWriter, code, msg, pushback string) {
	hdr := w.Header()
	hdr[hdrContentType] = []string{"application/grpc"}
	hdr[hdrGRPCStatus] = []string{code}
	hdr[hdrGRPCMessage] = []string{grpcMessage(msg)}
	if pushback != "" {
		hdr[hdrGRPCPushback] = []string{pushback}
	}
	w.WriteHeader(http.StatusOK)
}

// grpcPushback returns grpc-retry-pushback-ms for a denial: the wait of Retry-After in whole
// milliseconds, exact rather than rounded up to seconds (so a zone of 10 per second asks for
// about 100ms, not 1s), at least 1, plus the same jitter as Retry-After (retryAfter less the
// whole seconds of the exact wait waitMs); grpcNoRetry when waiting cannot cure the denial.
func grpcPushback(waitMs, retryAfter int64, unsatisfiable bool) string {
	if unsatisfiable {
		return grpcNoRetry
	}
	waitMs = max(waitMs, 1)
	jitter := retryAfter - max((waitMs+999)/1000, 1)
	return strconv.FormatInt(waitMs+max(jitter, 0)*1000, 10)
}

// grpcMessage percent-encodes s as grpc-message requires (PROTOCOL-HTTP2.md): every byte outside
// 0x20 to 0x7E, and '%', as %XX with upper-case hex digits. s itself when nothing needs it.
func grpcMessage(s string) string {
	i := strings.IndexFunc(s, func(r rune) bool { return r < 0x20 || r > 0x7E || r == '%' })
	if i < 0 {
		return s
	}
	const hex = "0123456789ABCDEF"
	b := make([]byte, 0, len(s)+16)
	b = append(b, s[:i]...)
	for j := i; j < len(s); j++ {
		if c := s[j]; c < 0x20 || c > 0x7E || c == '%' {
			b = append(b, '%', hex[c>>4], hex[c&0xF])
		} else {
			b = append(b, c)
		}
	}
	return string(b)
}
