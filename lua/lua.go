// Package lua holds the Redis Lua scripts of the limiter, embedded at build time. Each script
// opens with a comment stating its KEYS, ARGV and reply.
package lua

import _ "embed"

// Decide is decide.lua: it admits or denies one request against every zone that applies to it,
// all-or-nothing, in one atomic execution.
//
//go:embed decide.lua
var Decide string

// Refund is refund.lua: it gives back what one admitting Decide call charged, when the request
// was denied by a zone in another Redis Cluster hash slot.
//
//go:embed refund.lua
var Refund string
