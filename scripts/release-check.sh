#!/usr/bin/env bash
# make release-check: fails, naming each problem, on what would break the release of VERSION
# (default: the newest version of CHANGELOG.md). It checks the git tree in the current directory
# and changes nothing in it; last it runs the tests (RELEASE_TEST_CMD, default `make test`).
set -uo pipefail
export PATH="$PATH:/usr/local/go/bin"

fail=0
problem() { echo "release-check: $*" >&2; fail=1; }

version="${VERSION:-}"
if [ -z "$version" ] && [ -f CHANGELOG.md ]; then
	version=v$(sed -n 's/^## \[\([0-9][0-9.]*\)\].*/\1/p' CHANGELOG.md | sed -n 1p)
fi
version="v${version#v}"
if ! [[ "$version" =~ ^v[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
	problem "no version to check: set VERSION=vX.Y.Z or give CHANGELOG.md a '## [X.Y.Z]' section (got '$version')"
fi
bare="${version#v}"

# The changelog: the version's section dated (## [X.Y.Z] - YYYY-MM-DD) with at least one entry,
# and no entry above it under Unreleased (a change listed there would not be in the release).
if [ ! -f CHANGELOG.md ]; then
	problem "CHANGELOG.md is missing"
else
	heading=$(grep -F -m1 "## [$bare]" CHANGELOG.md)
	if [ -z "$heading" ]; then
		problem "CHANGELOG.md has no '## [$bare]' section"
	elif ! [[ "$heading" =~ ^\#\#\ \[$bare\]\ -\ [0-9]{4}-[0-9]{2}-[0-9]{2}$ ]]; then
		problem "CHANGELOG.md's heading of $version is not dated '## [$bare] - YYYY-MM-DD': '$heading'"
	fi
	entries=$(awk -v h="## [$bare]" 'index($0, h) == 1 { on = 1; next } /^## / { on = 0 } on && /^- / { n++ } END { print n + 0 }' CHANGELOG.md)
	[ "$entries" -gt 0 ] || problem "CHANGELOG.md has no entry for $version (a '## [$bare]' section with '- ' lines)"
	unreleased=$(awk '/^## \[Unreleased\]/ { on = 1; next } /^## / { on = 0 } on && /^- / { n++ } END { print n + 0 }' CHANGELOG.md)
	[ "$unreleased" -eq 0 ] || problem "CHANGELOG.md has $unreleased entries under Unreleased: move them into $version's section"
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
		problem "go.mod has a replace directive: $(grep -m1 -E '^[[:space:]]*replace' go.mod)"
	fi
	if ! tidy=$(go mod tidy -diff 2>&1); then
		problem "go mod tidy would change go.mod or go.sum (run go mod tidy):"$'\n'"$tidy"
	fi
fi

# The docs: no paragraph saying a release is still to come (its lines joined, so that a phrase
# broken over two lines is found). docs/releasing.md describes releases and is not checked.
for f in README.md CHANGELOG.md docs/*.md; do
	[ -f "$f" ] && [ "$f" != docs/releasing.md ] || continue
	awk -v f="$f" 'BEGIN { RS = "" }
		{ p = tolower($0); gsub(/[ \t\n]+/, " ", p) }
		p ~ /not (yet )?published|unpublished|not yet (released|tagged)|not released|until (that|the) (tag|release)|only after a release|(is|are) still to come|upcoming release|once (it is|v[0-9.]+ is) (released|tagged|published)/ {
			printf "release-check: %s says a release is still to come:\n%s\n", f, $0; bad = 1 }
		END { exit bad }' "$f" >&2 || fail=1
done

# git: a work tree whose version tag does not exist yet.
if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
	problem "not a git work tree: the release is a tag of a commit"
elif git rev-parse -q --verify "refs/tags/$version" >/dev/null; then
	problem "the tag $version already exists: a tag is never moved, so release a new version"
fi

# The tests, last: only a tree that passes the rest is worth their minutes.
if [ "$fail" -eq 0 ]; then
	test_cmd="${RELEASE_TEST_CMD:-make test}"
	if ! bash -c "$test_cmd"; then
		problem "the tests failed ($test_cmd)"
	fi
fi

if [ "$fail" -ne 0 ]; then
	echo "release-check: $version cannot be released as the tree stands" >&2
	exit 1
fi
echo "release-check: $version: dated CHANGELOG entry, nothing Unreleased, LICENSE, go.mod without replace and tidy, docs, no tag yet, tests: ok"
