package adminapi

// The admin API's top clients of a zone: GET /rate_limit_redis/top?zone=[&by=][&n=], the clients
// with the most denials or the most charged units in the zone's recent window (a zone with top;
// see limiter.ReadTop). It reads and writes nothing else.

import (
	"cmp"
	"context"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// The number of clients a top reply lists: the default and the most a request may ask for.
const (
	defaultTopN = 10
	maxTopN     = 1000
)

// TopReply is the reply of GET /rate_limit_redis/top.
type TopReply struct {
	// The zone, and what the counts are: "denied" (requests the zone denied) or "used" (units
	// it charged).
	Zone string `json:"zone"`
	By   string `json:"by"`
	// The length of a top bucket in milliseconds, and the start of the counts, in milliseconds
	// since the Unix epoch (the scripts' clock): the previous bucket's start, so the counts
	// cover window_ms to twice that.
	WindowMs int64 `json:"window_ms"`
	SinceMs  int64 `json:"since_ms"`
	// The clients, highest count first.
	Entries []TopEntry `json:"entries"`
}

// TopEntry is one client of a top reply.
type TopEntry struct {
	// The client key as {http.rate_limit_redis.key} shows it, or the digest that stands for it
	// (hashed, as in the listings), and which key candidate it is of (0: hidden by key_secret).
	Key       string `json:"key"`
	Hashed    bool   `json:"hashed,omitempty"`
	Candidate int    `json:"candidate"`
	// Its denials or units since since_ms; never below the true count, and above it by at most
	// error (itself at most the bucket's total divided by the zone's top; see
	// docs/operations.md).
	Count int64 `json:"count"`
	// How much of count may be other clients' (the count it started from when it took another
	// client's place in a full top; 0: count is exact), and count less error: the denials or
	// units that are certainly this client's.
	Error      int64 `json:"error"`
	Guaranteed int64 `json:"guaranteed"`
	// The Redis addresses and database the count was read from.
	Redis []string `json:"redis"`
	DB    int      `json:"db,omitempty"`
}

// handleTop serves GET /rate_limit_redis/top?zone=[&by=denied|used][&n=]: the n clients
// (default 10, 1 to 1000) with the highest counts in every distinct Redis and key prefix of the
// zone, highest first. Errors: 400 (no zone of that name, a zone without top, a bad by or n,
// before anything is sent to Redis), 405, 502, 504.
func (a *AdminAPI) handleTop(w http.ResponseWriter, r *http.Request) error {
	if err := allowMethods(w, r, http.MethodGet); err != nil {
		return err
	}
	q := r.URL.Query()
	srcs, err := a.topSources(q.Get("zone"))
	if err != nil {
		return err
	}
	by, err := topBy(q)
	if err != nil {
		return err
	}
	n, err := topCount(q)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(r.Context(), adminTimeout)
	defer cancel()
	reply := TopReply{Zone: srcs[0].info.Name, By: q.Get("by"), WindowMs: srcs[0].Params().TopWindow.Milliseconds(), Entries: []TopEntry{}}
	reply.By = cmp.Or(reply.By, "denied")
	for i, t := range srcs {
		top, since, err := t.Limiter().ReadTop(ctx, t.Params(), by, n)
		if err != nil {
			return t.redisError(err)
		}
		if i == 0 {
			reply.SinceMs = since.UnixMilli()
		}
		for _, e := range top {
			shown, hashed := limiter.ShownKey(e.Client)
			candidate, _ := limiter.ParseCandidateKey(shown)
			reply.Entries = append(reply.Entries, TopEntry{Key: shown, Hashed: hashed, Candidate: candidate, Count: e.Count,
				Error: e.Error, Guaranteed: e.Guaranteed(), Redis: t.info.Redis, DB: t.info.DB})
		}
	}
	slices.SortStableFunc(reply.Entries, func(a, b TopEntry) int { return cmp.Compare(b.Count, a.Count) })
	reply.Entries = reply.Entries[:min(n, len(reply.Entries))]
	return writeJSON(w, reply)
}

// topSources returns the zones named zone to read the top of (zoneSources). Every loaded zone
// of that name must have a top, else a 400.
func (a *AdminAPI) topSources(zone string) ([]target, error) {
	return a.zoneSources(zone, func(t target) error {
		if t.Params().Top <= 0 {
			return fmt.Errorf("zone %s has no top: add `top <entries>` to its block to count its clients", zone)
		}
		return nil
	})
}

// topBy returns the by query parameter: denied (the default) or used, else a 400.
func topBy(q url.Values) (limiter.TopBy, error) {
	v, ok := q["by"]
	switch {
	case !ok:
		return limiter.TopDenied, nil
	case len(v) == 1 && v[0] == "denied":
		return limiter.TopDenied, nil
	case len(v) == 1 && v[0] == "used":
		return limiter.TopUsed, nil
	}
	return 0, badRequest(fmt.Errorf("by: %q must be denied or used", strings.Join(v, ",")))
}

// topCount returns the n query parameter: defaultTopN when absent, else one integer from 1 to
// maxTopN (else a 400).
func topCount(q url.Values) (int, error) {
	v, ok := q["n"]
	if !ok {
		return defaultTopN, nil
	}
	n, err := strconv.Atoi(v[0])
	if err != nil || n < 1 || n > maxTopN || len(v) > 1 {
		return 0, badRequest(fmt.Errorf("n: %q must be one integer from 1 to %d", strings.Join(v, ","), maxTopN))
	}
	return n, nil
}
