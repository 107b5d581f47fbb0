# The commands of README.md and docs/development.md. Go 1.26 and (for `make test`/`make run`) redis-server are needed;
# redis-server is installed with apt-get when missing and run as root, and so are prometheus
# (promtool and the Prometheus end-to-end test) and Node.js with npm (the SDK tests); without
# them, those are skipped, saying so.
CADDY_VERSION ?= v2.11.9
# caddy-l4, the layer4 app the connection handler (package l4) runs in; the version go.mod requires.
CADDY_L4_VERSION := v0.1.2
MODULE        := github.com/rate-limit-redis/caddy-rate-limit-redis
# xcaddy needs a version for a local module; this one stands for "this checkout".
LOCAL_VERSION := v0.0.0-00010101000000-000000000000
# What bin/caddy is built from: no test file, nor the packages only tests import (a test edit need
# not rebuild Caddy).
TEST_PACKAGES := ./internal/caddytest ./internal/freeport ./internal/redistest ./internal/repocheck
SOURCES       := $(shell find . \( -path ./bin -o -path ./bench $(patsubst %,-o -path %,$(TEST_PACKAGES)) \) -prune -o \( -name '*.go' ! -name '*_test.go' -o -name '*.lua' \) -print) go.mod go.sum

.PHONY: build run test compose-check rules-check e2e fmt adapt smoke bench bench-queue bench-l4 bench-adaptive fuzz release-check release

## build: bin/caddy, Caddy $(CADDY_VERSION) with this module: the HTTP handler, and caddy-l4 with
## the connection handler (README.md "Install" gives this recipe; TestReadmeInstall checks that
## they agree)
build: bin/caddy

# xcaddy has Go look up the l4 package as a module of its own before it finds it in this
# checkout; "|off" makes the proxy's refusal (403 on some proxies, 404 on proxy.golang.org) a
# "not found", so that the lookup falls through to the checkout.
bin/caddy: $(SOURCES)
	GOPROXY='https://proxy.golang.org|off' go tool xcaddy build $(CADDY_VERSION) --output bin/caddy --with $(MODULE)@$(LOCAL_VERSION)=. --with $(MODULE)/l4 --with github.com/mholt/caddy-l4@$(CADDY_L4_VERSION)

## run: bin/caddy serving Caddyfile.example on :8080 against the Redis at $REDIS_ADDR (default
## 127.0.0.1:6379, a throwaway one when none answers there), with $REDIS_PASSWORD and
## $REDIS_USERNAME when set; it stops at once, saying why, when that Redis cannot be used
run: bin/caddy
	scripts/run.sh

## test: gofmt check, go vet, staticcheck and actionlint on .github/workflows (Go tools of go.mod),
## the alerting rules' unit tests,
## and every test with the race detector against real redis-server, the Prometheus end-to-end
## test (deploy/) with bin/caddy, the official OpenAI and Anthropic Node SDKs (e2e/sdk_test.go;
## node and npm are installed with apt-get when missing, the SDKs with npm)
test: compose-check rules-check bin/caddy
	scripts/ensure-redis.sh
	scripts/ensure-node.sh
	@unformatted=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
		if [ -n "$$unformatted" ]; then echo "gofmt needed: $$unformatted"; exit 1; fi
	go vet ./...
	go tool staticcheck ./...
	go tool actionlint .github/workflows/*.yml
	CADDY_BINARY=$(CURDIR)/bin/caddy go test -race -count=1 ./...

## rules-check: promtool checks the alerting rules (deploy/prometheus) and runs their unit tests
rules-check:
	scripts/ensure-prometheus.sh
	@if command -v promtool >/dev/null 2>&1; then \
		promtool check rules deploy/prometheus/*.yml && promtool test rules deploy/prometheus/tests/*.yml; \
	else echo "rules-check: SKIPPED: promtool is not installed (Debian package prometheus)"; fi

## e2e: the compose stack's dashboard and alerts proven against bin/caddy, redis-server and a
## real Prometheus (TestPrometheusEndToEnd, about 2.5 minutes)
e2e: bin/caddy
	scripts/ensure-redis.sh
	scripts/ensure-prometheus.sh
	CADDY_BINARY=$(CURDIR)/bin/caddy go test -race -count=1 -v -run '^TestPrometheusEndToEnd$$' ./deploy

## compose-check: docker-compose.yml is a valid compose file (no Docker engine needed)
compose-check:
	scripts/ensure-compose.sh
	docker-compose -f docker-compose.yml config -q

## release-check: fails, naming each problem, on what would break the release of VERSION (default:
## the newest version of CHANGELOG.md): its heading undated or without entries, entries left under
## Unreleased, no LICENSE, a replace in go.mod, go.mod or go.sum not tidy, docs saying a release is
## still to come, not a git tree, the tag already there, red tests (docs/releasing.md)
release-check:
	scripts/release-check.sh

## release: on a clean main that passes release-check, tag VERSION (annotated, the CHANGELOG
## section its message); prints the push to run
release:
	scripts/release.sh

## smoke: bin/caddy with Caddyfile.example on a throwaway Redis, checked with curl
smoke: bin/caddy
	scripts/smoke.sh

## fmt: gofmt every Go file
fmt:
	gofmt -w $$(find . -path ./bin -prune -o -name '*.go' -print)

## adapt: the JSON config that Caddyfile.example adapts to
adapt: bin/caddy
	bin/caddy adapt --config Caddyfile.example --adapter caddyfile --pretty

## bench: plain Caddy vs Caddy with the module under wrk, alternating rounds; prints a table
## (settings: BENCH_ROUNDS, BENCH_DURATION, BENCH_WARMUP, BENCH_THREADS, BENCH_CONNECTIONS);
## then bench-l4, the same comparison for new connections through caddy-l4, and bench-adaptive.
## With ANCHOR_SRC=<a clone of github.com/mholt/caddy-ratelimit> the pinned scenario also
## measures that in-memory limiter (bin/caddy-anchor); without it, that side is skipped.
bench: bin/caddy bin/caddy-plain
	@if [ -z "$(ANCHOR_SRC)" ]; then \
		echo "bench: no ANCHOR_SRC: the pinned scenario skips the in-memory anchor (make bench ANCHOR_SRC=<clone of github.com/mholt/caddy-ratelimit>)"; \
	elif [ ! -f "$(ANCHOR_SRC)/go.mod" ]; then \
		echo "bench: ANCHOR_SRC=$(ANCHOR_SRC) has no go.mod: the pinned scenario skips the in-memory anchor"; \
	else $(MAKE) --no-print-directory bin/caddy-anchor; fi
	ANCHOR_SRC="$(ANCHOR_SRC)" scripts/bench.sh
	$(MAKE) --no-print-directory bench-l4
	$(MAKE) --no-print-directory bench-adaptive

## bench-adaptive: concurrency against adaptive_concurrency over 3 bin/caddy processes before an
## upstream of 8 places, in one run: Caddy CPU per request, Redis calls per second per instance,
## the time to settle after capacity steps (BenchmarkAdaptiveConcurrency; docs/adaptive.md)
bench-adaptive: bin/caddy
	scripts/ensure-redis.sh
	CADDY_BINARY=$(CURDIR)/bin/caddy go test -run '^$$' -bench BenchmarkAdaptiveConcurrency -benchtime 1x -count 3 ./e2e

## bench-l4: new connections through caddy-l4's echo, alone and behind rate_limit_redis, in one
## Caddy and one run (BenchmarkNewConnections): time and this process's CPU per connection
bench-l4:
	scripts/ensure-redis.sh
	go test -run '^$$' -bench BenchmarkNewConnections -benchtime 3000x -count 3 ./l4

## bench-queue: what waiting in a queue costs Redis and Caddy: 500 waiters over 3 instances
## (scripts/queue-bench.sh; docs/queues.md "What waiting costs")
bench-queue: bin/caddy
	scripts/queue-bench.sh

bin/caddy-plain: go.mod
	go tool xcaddy build $(CADDY_VERSION) --output bin/caddy-plain

# The in-memory anchor of `make bench`: Caddy with mholt/caddy-ratelimit built from the clone at
# ANCHOR_SRC (nothing is downloaded but Go modules from the module proxy; xcaddy needs an
# explicit version for a local module, as for bin/caddy). CI never builds it.
ANCHOR_SRC     ?=
ANCHOR_MODULE  := github.com/mholt/caddy-ratelimit
ANCHOR_SOURCES := $(if $(ANCHOR_SRC),$(shell find $(ANCHOR_SRC) -name '*.go' ! -name '*_test.go' -o -name go.mod -o -name go.sum 2>/dev/null))
bin/caddy-anchor: go.mod $(ANCHOR_SOURCES)
	@[ -n "$(ANCHOR_SRC)" ] && [ -f "$(ANCHOR_SRC)/go.mod" ] || \
		{ echo "bin/caddy-anchor: set ANCHOR_SRC to a clone of https://$(ANCHOR_MODULE)"; exit 1; }
	go tool xcaddy build $(CADDY_VERSION) --output bin/caddy-anchor \
		--with $(ANCHOR_MODULE)@$(LOCAL_VERSION)=$(abspath $(ANCHOR_SRC))

## fuzz: each fuzz target for FUZZTIME (default 30s); `make test` runs their seed corpora
## (the testdata/fuzz folder of each package). New failing inputs are written there: keep them.
FUZZTIME ?= 30s
fuzz:
	scripts/ensure-redis.sh
	go test -run XXX -fuzz '^FuzzUnmarshalCaddyfile$$' -fuzztime $(FUZZTIME) .
	go test -run XXX -fuzz '^FuzzZoneNumber$$' -fuzztime $(FUZZTIME) .
	go test -run XXX -fuzz '^FuzzUsage$$' -fuzztime $(FUZZTIME) ./internal/usage
	go test -run XXX -fuzz '^FuzzAnthropicUsage$$' -fuzztime $(FUZZTIME) ./internal/usage
	go test -run XXX -fuzz '^FuzzGeminiUsage$$' -fuzztime $(FUZZTIME) ./internal/usage
	go test -run XXX -fuzz '^FuzzCeilScaled$$' -fuzztime $(FUZZTIME) ./internal/usage
	go test -run XXX -fuzz '^FuzzModel$$' -fuzztime $(FUZZTIME) ./internal/usage
	go test -run XXX -fuzz '^FuzzSetOutputCap$$' -fuzztime $(FUZZTIME) ./internal/usage
	go test -run XXX -fuzz '^FuzzClientKey$$' -fuzztime $(FUZZTIME) ./internal/limiter
	go test -run XXX -fuzz '^FuzzDecodeReply$$' -fuzztime $(FUZZTIME) ./internal/limiter
	go test -run XXX -fuzz '^FuzzAllow$$' -fuzztime $(FUZZTIME) ./internal/limiter
