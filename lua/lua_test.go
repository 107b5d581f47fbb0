package lua

import (
	"strings"
	"testing"
)

// clock is the block with which every script reads its time: ARGV[1], or the Redis server's
// clock when it is empty. Each script holds its own copy (see the package comment); this test
// keeps the copies alike.
const clock = `
local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[1])
end
`

// TestScriptsReadTheClockAlike: decide.lua, settle.lua, refresh.lua and queue.lua each read now with the
// same lines, once.
func TestScriptsReadTheClockAlike(t *testing.T) {
	for name, src := range map[string]string{"decide.lua": Decide, "settle.lua": Settle, "refresh.lua": Refresh, "queue.lua": Queue} {
		if n := strings.Count(src, clock); n != 1 {
			t.Errorf("%s holds the clock block %d times, want once:%s", name, n, clock)
		}
	}
}
