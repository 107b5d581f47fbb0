package adminapi

// The admin API's listings of a zone's clients, a page at a time: GET
// /rate_limit_redis/blocks?zone= (a zone with block) and GET /rate_limit_redis/overrides?zone=
// (a zone with overrides). Keys are found with SCAN on each Redis server in turn (every
// primary of a Redis Cluster) and read without writing anything.

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// Page sizes of a listing, in entries: the default and the most a request may ask for.
const (
	defaultListCount = 100
	maxListCount     = 1000
)

// MaxScanCalls bounds the SCAN calls of one page, so that a page ends in bounded time however
// few of the keys Redis examines match: it then returns fewer entries and a cursor to go on.
const MaxScanCalls = 64

// ListedClient is the fields every entry of a listing begins with.
type ListedClient struct {
	// zone, key (the client key as {http.rate_limit_redis.key} shows it, or the digest that
	// stands for it), candidate, redis_key, redis and db, as in the replies about one client.
	// A digest's candidate is 0 when it is a key_secret's, which hides the candidate too.
	ClientEntry
	// Whether the Redis key holds a digest of the client key rather than the key itself (a key
	// longer than 64 bytes or with other bytes than [A-Za-z0-9._:@/-], or any key under
	// key_secret): key is then the digest, which the endpoints about one client do not take.
	Hashed bool `json:"hashed,omitempty"`
}

// BlockEntry is one entry of GET /rate_limit_redis/blocks.
type BlockEntry struct {
	ListedClient // redis_key: the block's
	// Whether the client is blocked now. A zone with block_max remembers a block as long again
	// after it ends (its strikes make the next one longer): such a client is listed, not
	// blocked.
	Blocked bool `json:"blocked"`
	// When the block ends, in milliseconds since the Unix epoch (the scripts' clock); absent
	// when it has ended.
	BlockedUntilMs *int64 `json:"blocked_until_ms,omitempty"`
	// Milliseconds (rounded up) until the block ends; 0 when it has ended.
	LeftMs int64 `json:"left_ms"`
	// How many blocks in a row the block ends (1: a first offence), and its length in
	// milliseconds.
	Strikes     int64 `json:"strikes"`
	LastBlockMs int64 `json:"last_block_ms"`
}

// OverrideEntry is one entry of GET /rate_limit_redis/overrides.
type OverrideEntry struct {
	ListedClient // redis_key: the override's (a hash)
	OverrideNumbers
}

// ListPage is the reply of a listing.
type ListPage[T any] struct {
	// The entries found in this page, in no particular order.
	Entries []T `json:"entries"`
	// The cursor to ask for the next page with; "" when the listing is complete.
	Cursor string `json:"cursor"`
}

// handleBlocks serves GET /rate_limit_redis/blocks?zone=[&count=][&cursor=].
func (a *AdminAPI) handleBlocks(w http.ResponseWriter, r *http.Request) error {
	return a.handleList(w, r, limiter.ListBlocks)
}

// handleOverrides serves GET /rate_limit_redis/overrides?zone=[&count=][&cursor=].
func (a *AdminAPI) handleOverrides(w http.ResponseWriter, r *http.Request) error {
	return a.handleList(w, r, limiter.ListOverrides)
}

// handleList serves a listing of kind k: a page of about count entries (default 100, 1 to 1000)
// from cursor ("" to start). A page stops scanning once it has count entries (SCAN returns its
// batches whole, so it may hold a few more), after MaxScanCalls SCAN calls, or at the end. Errors:
// 400 (no zone of that name, a zone without block or overrides, a bad count or cursor), 405,
// 502, 504.
func (a *AdminAPI) handleList(w http.ResponseWriter, r *http.Request, k limiter.ListKind) error {
	if err := allowMethods(w, r, http.MethodGet); err != nil {
		return err
	}
	q := r.URL.Query()
	srcs, err := a.listSources(q.Get("zone"), k)
	if err != nil {
		return err
	}
	count, err := listCount(q)
	if err != nil {
		return err
	}
	at, err := parseListCursor(q.Get("cursor"), len(srcs))
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(r.Context(), adminTimeout)
	defer cancel()
	found, next, err := scanPage(ctx, srcs, k, at, count)
	if err != nil {
		return err
	}
	if k == limiter.ListBlocks {
		entries, err := readBlocks(ctx, srcs, found)
		if err != nil {
			return err
		}
		return writeJSON(w, ListPage[BlockEntry]{Entries: entries, Cursor: next})
	}
	entries, err := readOverrides(ctx, srcs, found)
	if err != nil {
		return err
	}
	return writeJSON(w, ListPage[OverrideEntry]{Entries: entries, Cursor: next})
}

// listSources returns the zones named zone to list keys of kind k in (zoneSources). Every
// loaded zone of that name must have a block (ListBlocks) or overrides (ListOverrides), else a
// 400.
func (a *AdminAPI) listSources(zone string, k limiter.ListKind) ([]target, error) {
	return a.zoneSources(zone, func(t target) error {
		switch {
		case k == limiter.ListBlocks && t.Params().Block <= 0:
			return fmt.Errorf("zone %s has no block: no client of it is ever blocked", zone)
		case k == limiter.ListOverrides && !t.info.Overrides:
			return fmt.Errorf("zone %s has no overrides: add `overrides` to its block to set a client's numbers at run time", zone)
		}
		return nil
	})
}

// zoneSources returns the loaded zones named zone, one per distinct Redis and key_prefix, in
// the order of Registry.Zones; a 400 when zone is empty or not loaded, or when lacks returns
// an error for one of them (the zone lacks what the request reads).
func (a *AdminAPI) zoneSources(zone string, lacks func(target) error) ([]target, error) {
	if zone == "" {
		return nil, badRequest(fmt.Errorf("query parameter zone is required"))
	}
	ts := a.targets(zone)
	if len(ts) == 0 {
		return nil, badRequest(fmt.Errorf("no rate_limit_redis zone named %q is loaded", zone))
	}
	var srcs []target
	seen := make(map[string]bool)
	for _, t := range ts {
		if err := lacks(t); err != nil {
			return nil, badRequest(err)
		}
		if id := t.RedisID() + "|" + t.info.KeyPrefix; !seen[id] {
			seen[id] = true
			srcs = append(srcs, t)
		}
	}
	return srcs, nil
}

// listCount returns the count query parameter: defaultListCount when absent, else an integer
// from 1 to maxListCount (else a 400).
func listCount(q map[string][]string) (int, error) {
	v, ok := q["count"]
	if !ok {
		return defaultListCount, nil
	}
	n, err := strconv.Atoi(v[0])
	if err != nil || n < 1 || n > maxListCount || len(v) > 1 {
		return 0, badRequest(fmt.Errorf("count: %q must be one integer from 1 to %d", strings.Join(v, ","), maxListCount))
	}
	return n, nil
}

// listCursor is where a listing goes on: the source (listSources), the Redis server among its
// primaries (sharedClient.primaries), and the SCAN cursor on it. Its text form is
// "<source>.<server>.<scan cursor>", in decimal.
type listCursor struct {
	src, node int
	scan      uint64
}

func (c listCursor) String() string { return fmt.Sprintf("%d.%d.%d", c.src, c.node, c.scan) }

// parseListCursor reads a cursor of a listing of srcs sources; "" is the start. The server is
// checked against its source's primaries when they are known (scanPage).
func parseListCursor(s string, srcs int) (listCursor, error) {
	var c listCursor
	if s == "" {
		return c, nil
	}
	parts := strings.Split(s, ".")
	var errs [3]error
	if len(parts) == 3 {
		c.src, errs[0] = strconv.Atoi(parts[0])
		c.node, errs[1] = strconv.Atoi(parts[1])
		c.scan, errs[2] = strconv.ParseUint(parts[2], 10, 64)
	}
	if len(parts) != 3 || errs != [3]error{} || c.src < 0 || c.src >= srcs || c.node < 0 {
		return c, badCursor(s)
	}
	return c, nil
}

// badCursor is the 400 of a cursor that no page of this listing returned.
func badCursor(s string) error {
	return badRequest(fmt.Errorf("cursor: %q is not a cursor of this listing: give the cursor of the last page, or none to start again", s))
}

// scanPage scans for the keys of kind k from cursor at, until it has count keys or has made
// MaxScanCalls SCAN calls, and returns them by source (found[i] is srcs[i]'s) and the next
// page's cursor ("" at the end).
func scanPage(ctx context.Context, srcs []target, k limiter.ListKind, at listCursor, count int) (found [][]string, next string, err error) {
	found = make([][]string, len(srcs))
	var nodes []limiter.Scanner // srcs[at.src]'s
	n := 0
	for calls := 0; calls < MaxScanCalls && n < count; calls++ {
		t := srcs[at.src]
		if nodes == nil {
			if nodes, err = t.Primaries(ctx); err != nil {
				return nil, "", t.redisError(err)
			}
			if at.node >= len(nodes) {
				return nil, "", badCursor(at.String())
			}
		}
		keys, scan, err := limiter.ScanZone(ctx, nodes[at.node], t.info.KeyPrefix, t.info.Name, k, at.scan, int64(count-n))
		if err != nil {
			return nil, "", t.redisError(err)
		}
		found[at.src] = append(found[at.src], keys...)
		n += len(keys)
		if at.scan = scan; scan != 0 {
			continue
		}
		if at.node++; at.node < len(nodes) {
			continue
		}
		if at.src, at.node, nodes = at.src+1, 0, nil; at.src == len(srcs) {
			return found, "", nil
		}
	}
	return found, at.String(), nil
}

// listed returns the ListedClient of Redis key key of source t, a key of kind k.
func listed(t target, k limiter.ListKind, key string) ListedClient {
	client, _ := limiter.ListedClient(t.info.KeyPrefix, t.info.Name, k, key) // ScanZone checked it
	shown, hashed := limiter.ShownKey(client)
	candidate, _ := limiter.ParseCandidateKey(shown)
	return ListedClient{
		ClientEntry: ClientEntry{Zone: t.info.Name, Key: shown, Candidate: candidate, RedisKey: key, Redis: t.info.Redis, DB: t.info.DB},
		Hashed:      hashed,
	}
}

// readBlocks reads the block keys found in each source.
func readBlocks(ctx context.Context, srcs []target, found [][]string) ([]BlockEntry, error) {
	out := []BlockEntry{}
	for i, keys := range found {
		bs, err := srcs[i].Limiter().ReadBlocks(ctx, keys)
		if err != nil {
			return nil, srcs[i].redisError(err)
		}
		for _, b := range bs {
			e := BlockEntry{ListedClient: listed(srcs[i], limiter.ListBlocks, b.Key), Strikes: b.Strikes, LastBlockMs: limiter.CeilMs(b.Length)}
			if b.Left > 0 {
				until := b.Until.UnixMilli()
				e.Blocked, e.BlockedUntilMs, e.LeftMs = true, &until, limiter.CeilMs(b.Left)
			}
			out = append(out, e)
		}
	}
	return out, nil
}

// readOverrides reads the override keys found in each source.
func readOverrides(ctx context.Context, srcs []target, found [][]string) ([]OverrideEntry, error) {
	out := []OverrideEntry{}
	for i, keys := range found {
		os, err := srcs[i].Limiter().ReadOverrides(ctx, keys)
		if err != nil {
			return nil, srcs[i].redisError(err)
		}
		for _, o := range os {
			e := OverrideEntry{ListedClient: listed(srcs[i], limiter.ListOverrides, o.Key)}
			e.set(o.Override, o.TTL)
			out = append(out, e)
		}
	}
	return out, nil
}
