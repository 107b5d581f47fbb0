package l4_test

import (
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/repocheck"
)

// TestMain runs the tests from the repository's root, where the cookbook is.
func TestMain(m *testing.M) {
	if err := os.Chdir(".."); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}

// TestCookbookSSHConnections runs the cookbook's recipe "SSH connections" as written (its
// listener moved to a free loopback port, its proxy sent to a TCP echo server standing for
// sshd) against a real Redis with a password: of 3 connections open at once, 2 reach the
// upstream and the third is closed unanswered.
func TestCookbookSSHConnections(t *testing.T) {
	var recipe *repocheck.Recipe
	for _, r := range repocheck.Recipes(t) {
		if r.Heading == "SSH connections" && len(r.Blocks) == 1 {
			recipe = &r
		}
	}
	if recipe == nil {
		t.Fatalf("%s has no recipe \"SSH connections\" with one caddyfile block", repocheck.Cookbook)
	}
	srv := redistest.StartWithPassword(t, "cookbook-secret")
	t.Setenv("REDIS_ADDR", srv.Addr)
	t.Setenv("REDIS_PASSWORD", "cookbook-secret")
	sshd, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sshd.Close() })
	go func() {
		for {
			c, err := sshd.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c); _ = c.Close() }()
		}
	}()
	port := freeport.Must(t)
	caddyfile := recipe.Blocks[0].Text
	for _, p := range [][2]string{
		{"{\n\tlayer4 {\n", "{\n\tadmin off\n\tpersist_config off\n\tlayer4 {\n"},
		{"\t\t:22 {\n", fmt.Sprintf("\t\t127.0.0.1:%d {\n", port)},
		{"proxy localhost:8022\n", "proxy " + sshd.Addr().String() + "\n"},
		{"rate_limit_redis {\n", "rate_limit_redis {\n\t\t\t\t\ttimeout 5s\n"},
	} {
		if !strings.Contains(caddyfile, p[0]) {
			t.Fatalf("%s: the recipe has no %q", recipe.Blocks[0].Where, p[0])
		}
		caddyfile = strings.Replace(caddyfile, p[0], p[1], 1)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	if err := caddytest.LoadCaddyfile(t, caddyfile); err != nil {
		t.Fatalf("%s: the recipe does not load: %v", recipe.Blocks[0].Where, err)
	}
	admitted := 0
	for range 3 {
		if _, ok := dial(t, port, ""); ok {
			admitted++
		}
	}
	if admitted != 2 {
		t.Fatalf("3 SSH connections open at once against the recipe's limit of 2: %d reached the upstream", admitted)
	}
}
