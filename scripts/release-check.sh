#!/usr/bin/env bash
# make release-check: fails, naming each problem, on what would break the release of VERSION
# (default: the newest version of CHANGELOG.md). It checks the tree in the current directory and
# changes nothing in it.
set -uo pipefail
export PATH="$PATH:/usr/local/go/bin"

fail=0
problem() { echo "release-check: $*" >&2; fail=1; }

version="${VERSION:-}"
if [ -z "$version" ] && [ -f CHANGELOG.md ]; then
	version=v$(sed -n 's/^## \[\([0-9][0-9.]*\)\].*/\1/p' CHANGELOG.md | head -n1)
fi
version="v${version#v}"
if ! [[ "$version" =~ ^v[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
	problem "no version to check: set VERSION=vX.Y.Z or give CHANGELOG.md a '## [X.Y.Z]' section (got '$version')"
fi
bare="${version#v}"

# The changelog: an Unreleased section, and a section for the version with at least one entry.
if [ ! -f CHANGELOG.md ]; then
	problem "CHANGELOG.md is missing"
else
	grep -q '^## \[Unreleased\]' CHANGELOG.md || problem "CHANGELOG.md has no '## [Unreleased]' section"
	entries=$(awk -v h="## [$bare]" 'index($0, h) == 1 { on = 1; next } /^## / { on = 0 } on && /^- / { n++ } END { print n + 0 }' CHANGELOG.md)
	[ "$entries" -gt 0 ] || problem "CHANGELOG.md has no entry for $version (a '## [$bare]' section with '- ' lines)"
fi

# The licence.
if [ ! -f LICENSE ] || ! grep -q 'Apache License' LICENSE || ! grep -q 'Version 2.0' LICENSE; then
	problem "LICENSE is missing or is not the Apache License 2.0"
fi

# go.mod: no replace directive (the module proxy's users would not get it), and tidy.
if [ ! -f go.mod ]; then
	problem "go.mod is missing"
else
	if grep -Eq '^[[:space:]]*replace([[:space:]]|\()' go.mod; then
		problem "go.mod has a replace directive: $(grep -E '^[[:space:]]*replace' go.mod | head -n1)"
	fi
	if ! tidy=$(go mod tidy -diff 2>&1); then
		problem "go mod tidy would change go.mod or go.sum (run go mod tidy):"$'\n'"$tidy"
	fi
fi

# The docs: no paragraph that names the version and says it is not published.
for f in README.md docs/*.md; do
	[ -f "$f" ] || continue
	awk -v v="$version" -v f="$f" 'BEGIN { RS = "" }
		index($0, v) && tolower($0) ~ /not (yet )?published|unpublished|not yet released|not released/ {
			printf "release-check: %s says %s is not published:\n%s\n", f, v, $0; bad = 1 }
		END { exit bad }' "$f" >&2 || fail=1
done

if [ "$fail" -ne 0 ]; then
	echo "release-check: $version cannot be released as the tree stands" >&2
	exit 1
fi
echo "release-check: $version: CHANGELOG entry, LICENSE, go.mod without replace and tidy, docs: ok"
