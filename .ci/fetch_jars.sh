#!/usr/bin/env bash
# Fetch the jar sets the Kafka tests run (tests/jars/<set>/pom.xml: the broker, Spark's Kafka
# connector) from Maven Central into a machine cache, once per version of each pom: a set whose
# stamp holds its pom's hash is not fetched again. Tests find the sets at the same place.
set -euo pipefail
cd "$(dirname "$0")/.."

cache="${WMWATCH_JAR_CACHE:-$HOME/.cache/wmwatch/jars}"
command -v mvn >/dev/null 2>&1 || {
    echo "fetch_jars: mvn is missing; install Maven (apt-get install maven) and run again" >&2
    exit 1
}
mkdir -p "$cache"
for pom in tests/jars/*/pom.xml; do
    set_name="$(basename "$(dirname "$pom")")"
    target="$cache/$set_name"
    hash="$(sha256sum "$pom" | cut -d' ' -f1)"
    if [ -f "$target/.pom-sha256" ] && [ "$(cat "$target/.pom-sha256")" = "$hash" ]; then
        echo "== jars: $set_name cached in $target"
        continue
    fi
    echo "== jars: fetching $set_name into $target"
    # fetched beside the target and swapped in whole, so a cut-off fetch never looks complete
    staging="$(mktemp -d "$cache/.$set_name.XXXXXX")"
    if ! (cd "$(dirname "$pom")" && mvn -q -B -Dstyle.color=never dependency:copy-dependencies \
            -DincludeScope=runtime -DoutputDirectory="$staging"); then
        rm -rf "$staging"
        echo "fetch_jars: Maven could not fetch $set_name ($pom); check access to Maven Central" >&2
        exit 1
    fi
    echo "$hash" > "$staging/.pom-sha256"
    rm -rf "$target"
    mv "$staging" "$target"
done
