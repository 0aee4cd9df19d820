#!/usr/bin/env bash
# Before vs after in one run: a command run alternately in two commits' checkouts, same machine.
#   bash tools/ab.sh BEFORE AFTER ROUNDS -- command args...
# BEFORE and AFTER are git revisions (checked out as detached worktrees under $AB_DIR, default
# /tmp/kvscope-ab) or directories holding a checkout (where there is no git, e.g. a device
# machine). Each runs its own copy of the command's files (a benchmark script may differ
# between the two) with its own kvscope first on PYTHONPATH; output lines are prefixed with it.
set -euo pipefail
cd "$(dirname "$0")/.."
before="$1" after="$2" rounds="$3"
shift 3
[[ "${1:-}" == "--" ]] && shift
dir="${AB_DIR:-/tmp/kvscope-ab}"
mkdir -p "$dir"
trees=()
labels=()
for rev in "$before" "$after"; do
    if [[ -d "$rev" ]]; then
        trees+=("$(cd "$rev" && pwd)")
        labels+=("$rev")
    else
        sha=$(git rev-parse --short "$rev")
        [[ -d "$dir/$sha" ]] || git worktree add -q --detach "$dir/$sha" "$sha"
        trees+=("$dir/$sha")
        labels+=("$sha")
    fi
done
for ((i = 1; i <= rounds; i++)); do
    for k in 0 1; do
        (cd "${trees[$k]}" && PYTHONPATH="${trees[$k]}" "$@" 2>&1 | sed "s|^|[${labels[$k]} round $i] |")
    done
done
