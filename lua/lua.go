// Package lua holds the Redis Lua scripts of the limiter, embedded at build time. Each script
// opens with a comment stating its KEYS, ARGV and reply. Each begins with a `#!lua` shebang
// (Redis 7 script flags), so Redis 7.0 or later is required.
//
// Each script is embedded exactly as its file is, so that the line Redis names in a script
// error (user_script:<line>) is the file's line. The lines that read the time (ARGV[1], or the
// server's TIME when it is empty) are therefore copied into each script rather than prepended
// here, which would shift every line after the shebang; a test keeps the copies identical.
package lua

import _ "embed"

// Decide is decide.lua: it admits or denies a batch of requests in order, each against every
// zone that applies to it, all-or-nothing, in one atomic execution.
//
//go:embed decide.lua
var Decide string

// Settle is settle.lua: it commits, releases or settles to a reported amount what a Decide call
// with holds took: on Redis Cluster once the decisions of a request's other hash slots are known,
// and after the response for zones that charge then (count_status, charge).
//
//go:embed settle.lua
var Settle string

// Refresh is refresh.lua: it moves on the deadlines of a client's concurrency slots still in
// flight, and adds none back that are gone.
//
//go:embed refresh.lua
var Refresh string

// Queue is queue.lua: the waiters of a concurrency zone with a max_wait, which it enters,
// leaves, keeps alive and grants freed slots to, in priority classes.
//
//go:embed queue.lua
var Queue string
