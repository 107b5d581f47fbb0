package limiter

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Listings: a zone's blocks or overrides, found with SCAN (never KEYS) on one Redis server at a
// time and read without writing anything (no write, no TTL change). The caller pages through
// the servers (every primary of a Redis Cluster) with SCAN cursors.

// ListKind is what a listing finds in a zone: its clients' blocks or their overrides.
type ListKind int

const (
	// ListBlocks lists the block keys (BlockKey).
	ListBlocks ListKind = iota
	// ListOverrides lists the override keys (OverrideKey).
	ListOverrides
)

// suffix is the last segment of the keys of kind k.
func (k ListKind) suffix() string {
	if k == ListOverrides {
		return "ov"
	}
	return blockTag
}

// Scanner is what a listing needs of one Redis server: SCAN. *redis.Client has it.
type Scanner interface {
	Scan(ctx context.Context, cursor uint64, match string, count int64) *redis.ScanCmd
}

// ScanZone runs one SCAN on node from cursor with COUNT count (how many keys Redis examines, as
// a hint) and returns the Redis keys of kind k of the zone named zone under prefix among those
// examined, and the cursor to go on with (0: node scanned through). A key that matches SCAN's
// MATCH pattern but is not exactly `<prefix>{<client>}:<zone>:<suffix>` is left out.
func ScanZone(ctx context.Context, node Scanner, prefix, zone string, k ListKind, cursor uint64, count int64) (keys []string, next uint64, err error) {
	match := globEscape(prefix) + "{*}:" + globEscape(zone) + ":" + k.suffix()
	found, next, err := node.Scan(ctx, cursor, match, count).Result()
	if err != nil {
		return nil, 0, fmt.Errorf("redis SCAN %d MATCH %s: %w", cursor, match, err)
	}
	for _, key := range found {
		if _, ok := ListedClient(prefix, zone, k, key); ok {
			keys = append(keys, key)
		}
	}
	return keys, next, nil
}

// ListedClient returns the client part of key (the hash tag, as ClientKey wrote it) when key
// is exactly `<prefix>{<client>}:<zone>:<suffix of k>`; ok is false for any other key.
func ListedClient(prefix, zone string, k ListKind, key string) (client string, ok bool) {
	rest, ok := strings.CutPrefix(key, prefix+"{")
	if !ok {
		return "", false
	}
	i := strings.IndexByte(rest, '}')
	if i < 0 || strings.IndexByte(rest[:i], '{') >= 0 || rest[i+1:] != ":"+zone+":"+k.suffix() {
		return "", false
	}
	return rest[:i], true
}

// ShownKey returns the client key that a Redis key's client part (ClientKey's result) stands
// for, as {http.rate_limit_redis.key} shows it, when the Redis key holds it verbatim. hashed is
// true when it holds a digest (a long or unusual key, or a key_secret's keyed key): key is then
// the digest, which names no client key. The shared key of requests with no key is "".
func ShownKey(client string) (key string, hashed bool) {
	switch {
	case client == emptyClientKey:
		return "", false
	case strings.Contains(client, "~"):
		return client, true
	}
	n, _ := ParseCandidateKey(client)
	return client, n == KeyedCandidate
}

// ListedBlock is a block key found by a listing.
type ListedBlock struct {
	// Key is the Redis key.
	Key string
	// Until is when the block ends, on the scripts' clock; Left is how long until then (0 when
	// it has ended and only its strikes are remembered, with a BlockMax).
	Until time.Time
	Left  time.Duration
	// Length and Strikes are as in BlockState.
	Length  time.Duration
	Strikes int64
}

// ReadBlocks reads the block keys keys (as ScanZone found them) at the scripts' time (Redis
// TIME, or the Limiter's clock). A key gone since (expired or deleted), of another type, or
// whose value the decisions cannot read as a block, is left out.
func (l *Limiter) ReadBlocks(ctx context.Context, keys []string) ([]ListedBlock, error) {
	if len(keys) == 0 {
		return nil, nil
	}
	now, err := l.scriptTime(ctx)
	if err != nil {
		return nil, err
	}
	gets := make([]*redis.StringCmd, len(keys))
	p := l.rdb.Pipeline()
	for i, key := range keys {
		gets[i] = p.Get(ctx, key)
	}
	if _, err = p.Exec(ctx); !replyError(err) {
		return nil, fmt.Errorf("redis GET of %d block keys: %w", len(keys), err)
	}
	var out []ListedBlock
	for i, g := range gets {
		until, length, strikes, ok := parseBlock(g.Val())
		if g.Err() != nil || !ok {
			continue
		}
		b := ListedBlock{Key: keys[i], Until: time.UnixMicro(until), Length: time.Duration(length) * time.Microsecond, Strikes: strikes}
		if left := until - now.UnixMicro(); left > 0 {
			b.Left = time.Duration(left) * time.Microsecond
		}
		out = append(out, b)
	}
	return out, nil
}

// ListedOverride is an override key found by a listing.
type ListedOverride struct {
	// Key is the Redis key.
	Key string
	// Override is its numbers; TTL how long it lasts (0: until it is deleted).
	Override Override
	TTL      time.Duration
}

// ReadOverrides reads the override keys keys (as ScanZone found them). A key gone since, of
// another type, or with a field that does not parse (GetOverride's ErrBadResponse), is left
// out.
func (l *Limiter) ReadOverrides(ctx context.Context, keys []string) ([]ListedOverride, error) {
	if len(keys) == 0 {
		return nil, nil
	}
	alls := make([]*redis.MapStringStringCmd, len(keys))
	pttls := make([]*redis.DurationCmd, len(keys))
	p := l.rdb.Pipeline()
	for i, key := range keys {
		alls[i], pttls[i] = p.HGetAll(ctx, key), p.PTTL(ctx, key)
	}
	if _, err := p.Exec(ctx); !replyError(err) {
		return nil, fmt.Errorf("redis HGETALL of %d override keys: %w", len(keys), err)
	}
	var out []ListedOverride
	for i, all := range alls {
		o, err := parseOverride(keys[i], all.Val())
		if err != nil || all.Err() != nil || o.IsZero() {
			continue
		}
		out = append(out, ListedOverride{Key: keys[i], Override: o, TTL: max(0, pttls[i].Val())})
	}
	return out, nil
}

// replyError reports whether err, a pipeline's, is nil or a Redis error reply to one of its
// commands (a key gone, a key of another type: that key is left out), not a failure of the
// whole pipeline.
func replyError(err error) bool {
	var re redis.Error
	return err == nil || errors.As(err, &re)
}

// scriptTime is the time the scripts decide at: the Limiter's clock when it has one, else the
// Redis server's TIME.
func (l *Limiter) scriptTime(ctx context.Context) (time.Time, error) {
	if l.now != nil {
		return l.now(), nil
	}
	t, err := l.rdb.Time(ctx).Result()
	if err != nil {
		return time.Time{}, fmt.Errorf("redis TIME: %w", err)
	}
	return t, nil
}

// globEscape escapes the bytes that SCAN's MATCH pattern reads as glob syntax.
func globEscape(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if strings.IndexByte(`*?[]\`, s[i]) >= 0 {
			b.WriteByte('\\')
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
