package limiter

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/lua"
)

// A script call is never sent twice by the client after it may have reached Redis, on any
// topology: a decision would be charged twice, and a release of a window counter without its
// record taken twice. Every call is a onceCmd, whose NoRetry makes go-redis (v9) keep it to one
// write: the plain and Sentinel clients (MaxRetries -1 besides), and the Redis Cluster client,
// whose own loop (ClusterOptions.MaxRedirects, default 3) re-sends every command of a node's
// pipeline on EOF, a reset or a read timeout, including commands Redis had run. Each such re-send
// in go-redis is guarded by NoRetry (Client and ClusterClient process, the cluster pipeline's
// write, read and first-reply paths). The re-sends NoRetry leaves are safe by construction: they
// follow a reply by which Redis refused the call before running it (MOVED and ASK, followed to
// the node they name, with ASKING; READONLY), or happen before the call was written (a dial or
// pool failure, a closed node client, a connection found broken before the write).
//
// Why not MaxRedirects -1 instead: go-redis would then follow no MOVED or ASK either (it starts a
// reload of the slot map and fails the call). Following them ourselves needs the redirect's node
// (ASK: ASKING and the call on one connection to the importing node, which may not even be in the
// slot map yet), which go-redis does not expose. Nor a call made idempotent by its nonce: that
// needs a marker key written by every decision. NoRetry keeps go-redis's redirects and removes
// exactly the unsafe re-sends.
//
// What go-redis no longer re-sends and Redis refused without running it, sendAgain re-sends:
// NOSCRIPT (as EVAL), and TRYAGAIN (a call of several keys of a slot being migrated, some moved
// already, some not: it runs once the migration has moved them all). CLUSTERDOWN is not: a
// failover takes seconds, far beyond a decision's timeout, and fail_mode applies.

// script is one of the limiter's Lua scripts: its source and SHA1, run by EVALSHA (EVAL after
// NOSCRIPT).
type script struct {
	src, sha string
	// srcArg and shaArg are src and sha boxed once as command arguments: a string converted to
	// an interface allocates.
	srcArg, shaArg any
}

func newScript(src string) *script {
	h := sha1.Sum([]byte(src))
	sha := hex.EncodeToString(h[:])
	return &script{src: src, sha: sha, srcArg: src, shaArg: sha}
}

var (
	decideScript = newScript(lua.Decide)
	settleScript = newScript(lua.Settle)
)

// onceCmd is a command that no go-redis client sends again after it may have reached Redis.
type onceCmd struct{ *redis.Cmd }

// NoRetry is true: go-redis never re-sends the command after writing it (see above).
func (onceCmd) NoRetry() bool { return true }

// Clone returns a copy that is a onceCmd too.
func (c onceCmd) Clone() redis.Cmder { return onceCmd{c.Cmd.Clone().(*redis.Cmd)} }

// cmd returns the call of s with keys and args: EVALSHA, or EVAL when eval.
func (s *script) cmd(ctx context.Context, eval bool, keys []string, args []any) onceCmd {
	a := make([]any, 0, 3+len(keys)+len(args))
	if eval {
		a = append(a, "eval", s.srcArg, len(keys))
	} else {
		a = append(a, "evalsha", s.shaArg, len(keys))
	}
	for _, k := range keys {
		a = append(a, k)
	}
	c := redis.NewCmd(ctx, append(a, args...)...)
	if len(keys) > 0 {
		c.SetFirstKeyPos(3) // the cluster client routes the call by its first key
	}
	return onceCmd{c}
}

// maxSends bounds how many times one script call is sent: once, NOSCRIPT's EVAL, and after
// TRYAGAIN, at 1, 2, 4, 8, 16, then 32 ms apart (160 ms in all, longer than a decision's
// default timeout, which ends it first).
const maxSends = 10

// sendAgain reports whether a script call sent `sent` times (as EVAL when eval) that failed with
// err is sent again, as EVAL (asEval), after a pause (wait): only when Redis refused it without
// running it, so that sending it again can never run it twice.
func sendAgain(err error, eval bool, sent int) (again, asEval, wait bool) {
	switch {
	case err == nil || sent >= maxSends:
		return false, eval, false
	case !eval && redis.HasErrorPrefix(err, "NOSCRIPT"):
		return true, true, false // not loaded on this server (restarted, flushed, a new node)
	case redis.HasErrorPrefix(err, "TRYAGAIN"):
		return true, eval, true
	}
	return false, eval, false
}

// pause waits before sending a refused call again, the `sent`-th time: 1 ms, doubling up to
// 32 ms (a migration moves a slot's keys a batch at a time, each MIGRATE a round trip between
// two nodes). False when ctx ends first.
func pause(ctx context.Context, sent int) bool {
	t := time.NewTimer(time.Millisecond << min(sent-1, 5))
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
