#!/usr/bin/env bash
# mmdebstrap --extract-hook for the FlexInfer base root filesystem (run on the host, as root; the
# extract variant runs no customize hooks).
#   $1  the root filesystem being built
# Env from base.sh: BASE_NODEPS (packages extracted without their dependencies),
# MMDEBSTRAP_APT_CONFIG (set by mmdebstrap: its apt config, lists still present).
# Shape follows gcr.io/distroless/cc-debian12:nonroot: glibc + libgcc, CA bundle, passwd/group with
# root, nobody and nonroot (65532), no shell, no package manager.
set -euo pipefail
root=$1
[[ -d $root/usr ]] || { echo "base-customize: $root is not a root filesystem" >&2; exit 1; }

# Packages wanted for their files only: base-files' Depends (mawk) and ca-certificates' (openssl,
# debconf -> perl-base) only serve maintainer scripts, which never run here; the one thing
# ca-certificates' postinst produces, the bundle, is generated below.
dl=$(mktemp -d)
trap 'rm -rf "$dl"' EXIT
if [[ -n ${BASE_NODEPS:-} ]]; then
  # shellcheck disable=SC2086  # a word list on purpose
  (cd "$dl" && APT_CONFIG=$MMDEBSTRAP_APT_CONFIG apt-get download -qq -o APT::Sandbox::User=root $BASE_NODEPS >&2)
  for deb in "$dl"/*.deb; do dpkg-deb --extract "$deb" "$root"; done
fi

# Package records for scanners (distroless layout: one control file per package in status.d).
mkdir -p "$root/var/lib/dpkg/status.d"
for deb in "$root"/var/cache/apt/archives/*.deb "$dl"/*.deb; do
  [[ -e $deb ]] || continue
  pkg=$(dpkg-deb --field "$deb" Package)
  dpkg-deb --field "$deb" Package Version Architecture Source Maintainer Homepage \
    > "$root/var/lib/dpkg/status.d/$pkg"
done

# CA bundle, as update-ca-certificates would write it with every Mozilla CA enabled.
mkdir -p "$root/etc/ssl/certs"
find "$root/usr/share/ca-certificates" -name '*.crt' -print0 | LC_ALL=C sort -z \
  | xargs -0 -r cat > "$root/etc/ssl/certs/ca-certificates.crt"
[[ -s $root/etc/ssl/certs/ca-certificates.crt ]] || { echo "base-customize: empty CA bundle" >&2; exit 1; }

# Users and groups (no base-passwd postinst runs in the extract variant).
cat > "$root/etc/passwd" <<'P'
root:x:0:0:root:/root:/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin
nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin
P
cat > "$root/etc/group" <<'G'
root:x:0:
tty:x:5:
staff:x:50:
nogroup:x:65534:
nonroot:x:65532:
G
cat > "$root/etc/nsswitch.conf" <<'N'
passwd:         files
group:          files
shadow:         files
hosts:          files dns
networks:       files
protocols:      files
services:       files
N
chmod 0644 "$root/etc/passwd" "$root/etc/group" "$root/etc/nsswitch.conf"
install -d -m 0700 "$root/root"
install -d -m 0700 -o 65532 -g 65532 "$root/home/nonroot"
install -d -m 1777 "$root/tmp"

# The runtime bind-mounts these; keep empty mount points instead of the build host's copies.
: > "$root/etc/resolv.conf"
: > "$root/etc/hostname"
chmod 0644 "$root/etc/resolv.conf" "$root/etc/hostname"
# Debian's layout (base-files' postinst makes these links).
rm -rf "$root/var/run" "$root/var/lock"
ln -s /run "$root/var/run"
ln -s /run/lock "$root/var/lock"

# Strip: docs (licence texts kept), man/info pages, locales, lintian, gconv modules (iconv only;
# nothing in FlexInfer calls iconv), the package cache.
find "$root/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete 2>/dev/null || true
find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete 2>/dev/null || true
rm -rf "$root"/usr/share/{man,info,locale,lintian,bug,doc-base} \
  "$root"/usr/lib/x86_64-linux-gnu/gconv "$root"/usr/lib/aarch64-linux-gnu/gconv \
  "$root"/var/cache/apt/archives/*.deb
