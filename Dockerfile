# Caddy v2.11.9 with this module (and caddy-l4 with its connection handler), built from this checkout with xcaddy in Caddy's official
# builder image. `docker compose up --build` uses it (docs/compose.md).
# CADDY_TAG is not called CADDY_VERSION: the builder image sets that variable itself.
ARG CADDY_TAG=2.11.9

FROM caddy:${CADDY_TAG}-builder AS builder
ARG CADDY_TAG
# go.mod may ask for a newer Go patch release than the image has: let go fetch that toolchain.
ENV GOTOOLCHAIN=auto
COPY . /src
# The explicit module version stands for "this checkout", as in the Makefile, so that the module
# proxy need not know the module. The builder's working directory is /usr/bin: this writes
# /usr/bin/caddy.
RUN GOPROXY='https://proxy.golang.org|off' xcaddy build "v${CADDY_TAG}" \
	--with "github.com/rate-limit-redis/caddy-rate-limit-redis@v0.0.0-00010101000000-000000000000=/src" \
	--with "github.com/rate-limit-redis/caddy-rate-limit-redis/l4" \
	--with "github.com/mholt/caddy-l4@v0.1.2"

FROM caddy:${CADDY_TAG}
COPY --from=builder /usr/bin/caddy /usr/bin/caddy
COPY deploy/Caddyfile /etc/caddy/Caddyfile
