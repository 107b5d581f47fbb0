#!/usr/bin/env bash
# Installs redis-server (Debian package) when it is missing: with apt-get as root, else it says
# which package to install and fails.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
	exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
	echo "redis-server is not installed. Install the Debian packages redis-server and redis-tools:" >&2
	echo "    sudo apt-get install redis-server redis-tools" >&2
	exit 1
fi
echo "installing redis-server with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq redis-server redis-tools >/dev/null
