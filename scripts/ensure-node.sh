#!/usr/bin/env bash
# Installs Node.js and npm (Debian packages nodejs and npm) when they are missing: with apt-get as
# root. The SDK tests (e2e/sdk_test.go) run the official OpenAI and Anthropic Node SDKs, which they
# install with npm into the user's cache directory. Where node cannot be installed (not root, or no
# apt-get) it says so and succeeds: those tests then skip, saying why, rather than fail.
set -euo pipefail
if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then
	exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
	echo "SKIPPING the SDK tests: node and npm are not installed, and cannot be installed here." >&2
	echo "Install Node.js 20 or later with npm (Debian: sudo apt-get install nodejs npm)" >&2
	exit 0
fi
echo "installing Node.js and npm with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
# A failed install is not a failure of the module: the SDK tests then skip, saying why.
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null; }; then
	echo "SKIPPING the SDK tests: apt-get could not install nodejs and npm." >&2
fi
