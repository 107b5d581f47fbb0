#!/usr/bin/env bash
# Installs docker-compose (Debian package, without the Docker engine it recommends) when it is
# missing: with apt-get as root, else it says which package to install and fails. `make test`
# only runs `docker-compose config`, which needs no engine.
set -euo pipefail
if command -v docker-compose >/dev/null 2>&1; then
	exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
	echo "docker-compose is not installed. Install the Debian package docker-compose:" >&2
	echo "    sudo apt-get install --no-install-recommends docker-compose" >&2
	exit 1
fi
echo "installing docker-compose with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends docker-compose >/dev/null
