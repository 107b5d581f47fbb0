package caddytest

import (
	"bufio"
	"net"
	"strconv"
	"testing"
	"time"
)

// DialEcho connects to a layer4 server on the loopback port whose admitted connections reach
// caddy-l4's echo handler (or any echo), sends prefix (a PROXY header, or nothing) and a line,
// and reports whether the line came back (admitted: the connection is returned, open until the
// test ends) or the connection was closed without a byte (refused). A partial or different
// answer fails t.
func DialEcho(t testing.TB, port int, prefix string) (net.Conn, bool) {
	t.Helper()
	c, err := net.DialTimeout("tcp", "127.0.0.1:"+strconv.Itoa(port), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte(prefix + "ping\n")); err != nil {
		_ = c.Close()
		return nil, false
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		_ = c.Close()
		if line != "" {
			t.Fatalf("a refused connection got %q before it closed; want nothing", line)
		}
		return nil, false
	}
	if line != "ping\n" {
		_ = c.Close()
		t.Fatalf("echo answered %q", line)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c, true
}
