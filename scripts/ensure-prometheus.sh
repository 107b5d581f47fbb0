#!/usr/bin/env bash
# Installs prometheus and promtool (Debian package prometheus) when they are missing: with
# apt-get as root. Where they cannot be installed (not root, or no apt-get) it says so and which
# package to install, and succeeds: `make test` then skips the alerting rule tests and the
# Prometheus end-to-end test, saying so, rather than failing.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
	exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
	echo "SKIPPING the alerting rule tests and the Prometheus end-to-end test: prometheus and promtool" >&2
	echo "are not installed, and cannot be installed here. Install the Debian package prometheus:" >&2
	echo "    sudo apt-get install --no-install-recommends prometheus" >&2
	exit 0
fi
echo "installing prometheus (prometheus, promtool) with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# The tests need the binaries, not the system service the package enables where systemd runs.
if [ -d /run/systemd/system ]; then
	systemctl disable --now prometheus >/dev/null 2>&1 || true
fi
