#!/usr/bin/env bash
# make release: tags the release of VERSION (default: the newest version of CHANGELOG.md) on the
# current commit, after scripts/release-check.sh passes on it. The tag is annotated, its message
# the version's section of CHANGELOG.md. It pushes nothing: it prints the push to run.
set -euo pipefail

version="${VERSION:-}"
if [ -z "$version" ] && [ -f CHANGELOG.md ]; then
	version=v$(sed -n 's/^## \[\([0-9][0-9.]*\)\].*/\1/p' CHANGELOG.md | sed -n 1p)
fi
version="v${version#v}"
bare="${version#v}"

branch=$(git symbolic-ref --short -q HEAD || true)
if [ "$branch" != main ]; then
	echo "release: a release is tagged on main; this is '${branch:-a detached HEAD}'" >&2
	exit 1
fi
if [ -n "$(git status --porcelain)" ]; then
	echo "release: the work tree has changes that are not committed (git status): commit them first" >&2
	exit 1
fi
VERSION="$version" "$(dirname "$0")/release-check.sh"

notes=$(awk -v h="## [$bare]" 'index($0, h) == 1 { on = 1; print; next } /^## |^\[/ { on = 0 } on' CHANGELOG.md)
git tag -a --cleanup=whitespace "$version" -F - <<<"$notes"
echo "release: tagged $version on $(git rev-parse --short HEAD); publish it with: git push origin $version"
