package redistest

import (
	"bufio"
	"io"
	"net"
	"sync"
	"testing"
)

// StartGarbage starts a TCP server on the loopback interface that speaks just enough RESP for
// go-redis to connect (HELLO is refused, so go-redis falls back to RESP2, the only command of its
// handshake with these client options) and answers every script command (EVALSHA, EVAL, SCRIPT)
// with reply, a raw RESP reply of any shape, closing the connection after it when hangUp is
// set, and returns its address. Its connections end with the test.
func StartGarbage(t testing.TB, reply string, hangUp bool) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	conns := make(map[net.Conn]bool)
	closed := false
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			if closed {
				mu.Unlock()
				c.Close()
				return
			}
			conns[c] = true
			wg.Add(1)
			mu.Unlock()
			go func() {
				defer wg.Done()
				serveGarbage(c, reply, hangUp)
				mu.Lock()
				delete(conns, c)
				mu.Unlock()
			}()
		}
	}()
	t.Cleanup(func() {
		l.Close()
		mu.Lock()
		closed = true
		for c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return l.Addr().String()
}

// serveGarbage answers the commands of c as StartGarbage says.
func serveGarbage(c net.Conn, reply string, hangUp bool) {
	defer c.Close()
	br := bufio.NewReader(c)
	for {
		_, name, err := readCommand(br)
		if err != nil {
			return
		}
		var out string
		switch name {
		case "hello":
			out = "-ERR unknown command 'HELLO'\r\n"
		case "ping":
			out = "+PONG\r\n"
		case "client", "auth", "select":
			out = "+OK\r\n"
		case "evalsha", "eval", "script":
			out = reply
		default:
			out = "-ERR unknown command '" + name + "'\r\n"
		}
		if _, err := io.WriteString(c, out); err != nil || (hangUp && out == reply) {
			return
		}
	}
}
