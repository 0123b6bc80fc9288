#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The C++ user's path: installs gradcomp from a configured and built tree (`cmake --install BUILD
# --component dev`: headers, the static library, the CMake package), then configures, builds and
# runs tests/consumer against it with find_package(gradcomp CONFIG) in a temporary folder (removed
# afterwards). Exits non-zero on any failure.
# Usage: tests/consumer/run.sh [BUILD]   (default build/py, the tree tests/setup.sh builds)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
build=${1:-build/py}
[ -f "$build/CMakeCache.txt" ] || { echo "consumer: $build is not a configured build tree" >&2; exit 1; }
cmake --build "$build" -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}" --target gradcomp_core >/dev/null
tmp=$(mktemp -d /tmp/gradcomp-consumer.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --component dev --prefix "$tmp/prefix" >/dev/null
echo "consumer: installed $(find "$tmp/prefix" -type f | wc -l) files from $build into $tmp/prefix"
cmake -S tests/consumer -B "$tmp/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
cmake --build "$tmp/build" >/dev/null
"$tmp/build/consumer"
