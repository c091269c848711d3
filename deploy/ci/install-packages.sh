#!/bin/sh
# Installs the Debian packages listed in apt-packages.txt (one per line; `#` starts a comment) that
# are not installed yet, for `make integration` (the tests that need system services: Slurm, etcd,
# network namespaces, ...). Only as root and only with apt-get; otherwise it installs nothing, says
# why, and exits 0: the tests that need a missing package then skip with their own reason (pytest -rs).
set -eu
list=$(dirname "$0")/apt-packages.txt
wanted=$(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$list" | grep -v '^$' || true)
uid=$(id -u)
if [ "$uid" != 0 ]; then
    echo "install-packages: not root (uid $uid): not installing $(echo $wanted) from $list; tests needing them skip"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-query >/dev/null 2>&1; then
    echo "install-packages: no apt-get/dpkg-query (not Debian?): not installing $(echo $wanted); tests needing them skip"
    exit 0
fi
missing=""
for package in $wanted; do
    if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
        missing="$missing $package"
    fi
done
if [ -z "$missing" ]; then
    echo "install-packages: all of $(echo $wanted) installed"
    exit 0
fi
echo "install-packages: installing$missing"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# shellcheck disable=SC2086 # one word per package
apt-get install -y -q $missing
