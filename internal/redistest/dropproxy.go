package redistest

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
)

// DropProxy is a TCP proxy in front of one Redis server that can lose a connection after Redis
// ran a script call, before its reply reaches the client: the case in which a client that sends
// the call again runs it twice. Armed (Arm), it forwards the next EVAL or EVALSHA whose
// arguments hold a given text, with the commands the client wrote together with it (the rest of
// its pipeline), then a PING; it waits until Redis has answered the PING (so Redis has run every
// one of them), and closes the client's connection without passing any of the replies on.
// Unarmed, it forwards both ways untouched. Each client connection has a connection of its own
// to the server.
type DropProxy struct {
	// Addr is the proxy's host:port on the loopback interface.
	Addr string
	// Target is the address of the server it forwards to.
	Target string

	ln      net.Listener
	mu      sync.Mutex
	match   []byte // armed: the text the script call to drop after holds; nil: not armed
	dropped atomic.Int64
	wg      sync.WaitGroup
	conns   map[net.Conn]struct{}
	closed  bool
}

// StartDropProxy starts a DropProxy to target on a free loopback port, stopped (its connections
// closed) when the test ends.
func StartDropProxy(t testing.TB, target string) *DropProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("drop proxy: %v", err)
	}
	p := &DropProxy{Addr: ln.Addr().String(), Target: target, ln: ln, conns: make(map[net.Conn]struct{})}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.stop)
	return p
}

// Arm makes the proxy drop the connection of the next script call (EVAL or EVALSHA) whose
// command, arguments included, holds text ("" for any script call), once Redis has run it.
func (p *DropProxy) Arm(text string) {
	p.mu.Lock()
	p.match = append([]byte{}, text...)
	p.mu.Unlock()
}

// Dropped is how many connections the proxy has dropped after Redis ran a script call.
func (p *DropProxy) Dropped() int { return int(p.dropped.Load()) }

// Dial dials addr, through the proxy when addr is its Target: a go-redis Dialer (Options.Dialer,
// ClusterOptions.Dialer) that puts the proxy in front of one node of a Redis Cluster whose nodes
// announce their own addresses.
func (p *DropProxy) Dial(ctx context.Context, network, addr string) (net.Conn, error) {
	if addr == p.Target {
		addr = p.Addr
	}
	var d net.Dialer
	return d.DialContext(ctx, network, addr)
}

func (p *DropProxy) stop() {
	p.mu.Lock()
	p.closed = true
	for c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
	_ = p.ln.Close()
	p.wg.Wait()
}

// track records c as open, so that stop closes it; false when the proxy is stopped (c is closed).
func (p *DropProxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		_ = c.Close()
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *DropProxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		if !p.track(c) {
			return
		}
		s, err := net.Dial("tcp", p.Target)
		if err != nil || !p.track(s) {
			_ = c.Close()
			continue
		}
		p.wg.Add(1)
		go p.serve(c, s)
	}
}

// serve forwards between client c and server s until either closes or the proxy drops them.
func (p *DropProxy) serve(c, s net.Conn) {
	defer p.wg.Done()
	closeBoth := func() {
		_ = c.Close()
		_ = s.Close()
		p.mu.Lock()
		delete(p.conns, c)
		delete(p.conns, s)
		p.mu.Unlock()
	}
	defer closeBoth()
	var dropping, ponged atomic.Bool
	down := make(chan struct{}) // closed when the server-to-client side ends
	p.wg.Add(1)
	go func() { // server to client
		defer p.wg.Done()
		defer close(down)
		var tail []byte // while dropping: the last bytes read, to find the PING's reply
		buf := make([]byte, 32<<10)
		for {
			n, err := s.Read(buf)
			if n > 0 {
				if dropping.Load() {
					tail = append(tail, buf[:n]...)
					if bytes.HasSuffix(tail, []byte("+PONG\r\n")) {
						ponged.Store(true)
						return
					}
					if len(tail) > 64 {
						tail = tail[len(tail)-64:]
					}
				} else if _, err := c.Write(buf[:n]); err != nil {
					closeBoth()
					return
				}
			}
			if err != nil {
				closeBoth()
				return
			}
		}
	}()
	br := bufio.NewReader(c)
	for { // client to server
		raw, name, err := readCommand(br)
		if err != nil {
			return
		}
		if !p.trigger(name, raw) {
			if _, err := s.Write(raw); err != nil {
				return
			}
			continue
		}
		dropping.Store(true) // from now on no reply reaches the client
		out := append([]byte{}, raw...)
		for br.Buffered() > 0 { // the rest of what the client wrote with it
			more, _, err := readCommand(br)
			if err != nil {
				break
			}
			out = append(out, more...)
		}
		out = append(out, "*1\r\n$4\r\nPING\r\n"...)
		if _, err := s.Write(out); err != nil {
			return
		}
		<-down
		if ponged.Load() { // Redis has run every command before the PING
			p.dropped.Add(1)
		}
		return
	}
}

// trigger reports whether the command named name, raw as the client sent it, is the armed
// script call, and disarms the proxy when it is.
func (p *DropProxy) trigger(name string, raw []byte) bool {
	if name != "evalsha" && name != "eval" {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.match == nil || !bytes.Contains(raw, p.match) {
		return false
	}
	p.match = nil
	return true
}

// readCommand reads one command as clients send them (a RESP array of bulk strings), and returns
// it as read and its lower-cased name.
func readCommand(br *bufio.Reader) (raw []byte, name string, err error) {
	line, err := br.ReadSlice('\n')
	if err != nil {
		return nil, "", err
	}
	raw = append(raw, line...)
	n, err := respLength(line, '*')
	if err != nil {
		return nil, "", err
	}
	for i := 0; i < n; i++ {
		line, err := br.ReadSlice('\n')
		if err != nil {
			return nil, "", err
		}
		raw = append(raw, line...)
		size, err := respLength(line, '$')
		if err != nil {
			return nil, "", err
		}
		arg := make([]byte, size+2)
		if _, err := io.ReadFull(br, arg); err != nil {
			return nil, "", err
		}
		raw = append(raw, arg...)
		if i == 0 {
			name = string(bytes.ToLower(arg[:size]))
		}
	}
	return raw, name, nil
}

// respLength parses a RESP header line such as "*3\r\n" or "$5\r\n" of the given type.
func respLength(line []byte, typ byte) (int, error) {
	if len(line) < 4 || line[0] != typ || !bytes.HasSuffix(line, []byte("\r\n")) {
		return 0, fmt.Errorf("drop proxy: unexpected %q, want a %c header", line, typ)
	}
	n, err := strconv.Atoi(string(line[1 : len(line)-2]))
	if err != nil || n < 0 {
		return 0, errors.New("drop proxy: bad length in " + strconv.Quote(string(line)))
	}
	return n, nil
}
