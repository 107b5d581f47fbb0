package ratelimitredis

import (
	"slices"
	"strings"
)

// The Redis ACL that docs/security.md ("Redis access") tells operators to give the module's
// user is derived from redisUses, the one list of the Redis commands the module sends: each
// script's (TestRedisACLListsEveryScriptCommand greps lua/*.lua and fails on a command missing
// from the list or listed but never called) and the Go code's. TestRedisACL runs every algorithm,
// charge mode, the reset broadcast and every admin endpoint under exactly that ACL, and checks
// that each command granted was called and none refused; TestDocumentedACL checks that the
// docs give redisACL's lines as they are.

// redisGrant is one `ACL SETUSER` line of the ACL: the commands every instance needs, or those
// one feature or topology adds.
type redisGrant int

const (
	// grantLimiter is every instance's: the decisions, the settlements, the reset broadcast.
	grantLimiter redisGrant = iota
	// grantAdmin is what an instance serving the admin API (admin.go) adds.
	grantAdmin
	// grantCluster is what a Redis Cluster client adds.
	grantCluster
	// grantDB is what `db` other than 0 adds.
	grantDB
)

// redisUse is a part of the module and the Redis commands it sends.
type redisUse struct {
	// by is the part: a script by its path (lua/decide.lua), else the Go code that sends.
	by    string
	grant redisGrant
	// commands are named as ACL rules name them: lower case, a subcommand as container|sub.
	commands []string
}

// redisUses lists every Redis command the module sends. go-redis opens each connection with
// HELLO (carrying AUTH), which needs no grant: Redis lets any user run a no-auth command. It
// sends nothing else there: CLIENT SETINFO and maintenance notifications are turned off
// (redis_client.go), and no connection is READONLY.
var redisUses = []redisUse{
	// limiter.runScript, limiter.evalBatch: EVALSHA, then EVAL after NOSCRIPT (a Redis that
	// has not seen the script yet, or flushed it). Never SCRIPT LOAD.
	{"limiter: running the scripts", grantLimiter, []string{"evalsha", "eval"}},
	{"lua/decide.lua", grantLimiter, []string{"time", "hmget", "hgetall", "zcount", "zrangebyscore", "zrange", "get",
		"pexpire", "hdel", "hset", "set", "zremrangebyscore", "zadd"}},
	{"lua/settle.lua", grantLimiter, []string{"time", "get", "del", "set", "hmget", "hset", "hdel", "pexpire", "zrem"}},
	{"lua/refresh.lua", grantLimiter, []string{"time", "zremrangebyscore", "zadd", "zrange", "pexpire"}},
	// limiter.ResetListener: SUBSCRIBE to <prefix>reset, and go-redis's health check of the
	// subscription, a PING after 3s without a message.
	{"limiter.ResetListener: the reset broadcast", grantLimiter, []string{"subscribe", "ping"}},
	// limiter.State (GET /rate_limit_redis/state): TIME, then one MULTI/EXEC reading the key
	// (a token bucket and a sliding window counter: HGETALL; a sliding window: ZCOUNT and
	// ZREVRANGEBYSCORE; a fixed window: GET) and its PTTL.
	{"limiter.State: the admin API's state", grantAdmin, []string{"multi", "exec", "time", "hgetall", "zcount",
		"zrevrangebyscore", "get", "pttl"}},
	// limiter.Reset (DELETE /rate_limit_redis/state): DEL of the key, PUBLISH of it on the
	// reset channel.
	{"limiter.Reset: the admin API's reset", grantAdmin, []string{"del", "publish"}},
	// go-redis's ClusterClient: the slot map (CLUSTER SLOTS) and the commands' key positions
	// (COMMAND), from any node.
	{"go-redis: Redis Cluster", grantCluster, []string{"cluster|slots", "command"}},
	// go-redis: SELECT <db> on each new connection when db is not 0.
	{"go-redis: db", grantDB, []string{"select"}},
}

// rules returns the ACL rules of line g: the commands of its uses that grantLimiter's line does
// not grant already, each once, in the order listed. grantLimiter's own line starts with the
// key and channel patterns of prefix and -@all.
func (g redisGrant) rules(prefix string) []string {
	var rules []string
	if g == grantLimiter {
		rules = []string{"~" + prefix + "*", "&" + prefix + "*", "-@all"}
	}
	for _, u := range redisUses {
		if u.grant != g {
			continue
		}
		for _, c := range u.commands {
			if (g == grantLimiter || !slices.Contains(grantLimiter.rules(prefix), "+"+c)) && !slices.Contains(rules, "+"+c) {
				rules = append(rules, "+"+c)
			}
		}
	}
	return rules
}

// redisACL returns the ACL of docs/security.md for user with password and key prefix prefix:
// one `ACL SETUSER` line per grant, in order. The first creates the user; each other adds to it.
func redisACL(user, password, prefix string) []string {
	var lines []string
	for g := grantLimiter; g <= grantDB; g++ {
		head := "ACL SETUSER " + user
		if g == grantLimiter {
			head += " on >" + password
		}
		lines = append(lines, head+" "+strings.Join(g.rules(prefix), " "))
	}
	return lines
}
