#!/bin/sh
# Set up the container agent environment's test image (docs/agent-environments.md):
#   1. podman, runc and debootstrap from apt when missing (needs root);
#   2. .cache/containers/containers.conf: runc, cgroupfs, a file events logger and explicit
#      nofile/nproc ulimits (crun and the default rlimits fail on these machines);
#   3. localhost/retrograd-agent:bookworm, a Debian minbase root with python3 and the builtin
#      tools' commands, user runner (uid 1000), /work mode 1777, imported into podman; and the
#      isolation tests' traps: ways to root that only setuid opens (a setuid-root copy of id,
#      sudo for runner without a password, root without a password), which the containers'
#      no-new-privileges must keep shut.
# Idempotent: an image of this RECIPE is kept (RETRO_AGENT_IMAGE_REBUILD=1 rebuilds it). About
# 100 s from scratch, under a second when done. Exits non-zero, saying why, when it cannot.
# Use the containers.conf it writes: export CONTAINERS_CONF=.cache/containers/containers.conf
set -eu

IMAGE=${RETRO_AGENT_IMAGE:-localhost/retrograd-agent:bookworm}
SUITE=bookworm
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=$ROOT/.cache/containers
CONF=$DIR/containers.conf
RECIPE=4 # bump when the image changes: an image of another recipe is rebuilt
PATHS=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

say() { echo "agent-image: $*" >&2; }

install_packages() {
    missing=""
    command -v podman >/dev/null 2>&1 || missing="$missing podman"
    command -v runc >/dev/null 2>&1 || missing="$missing runc"
    command -v debootstrap >/dev/null 2>&1 || missing="$missing debootstrap"
    [ -z "$missing" ] && return 0
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        say "missing:$missing; installing needs root and apt-get"
        return 1
    fi
    say "installing$missing"
    apt-get update -qq
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
}

write_conf() {
    mkdir -p "$DIR"
    cat >"$CONF.tmp" <<'CONF'
# Written by scripts/agent-image.sh. crun fails on this cgroup layout; without
# CAP_SYS_RESOURCE the default rlimits cannot be applied, so set them explicitly.
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
    mv "$CONF.tmp" "$CONF"
}

# The mirror apt uses: the first http(s) URI of the Debian sources.
mirror() {
    uri=$(grep -hoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' \
        /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null |
        grep -oE 'https?://[^ ]+' | head -n 1 || true)
    echo "${uri:-http://deb.debian.org/debian}"
}

build_image() {
    rootfs=$(mktemp -d "$DIR/rootfs.XXXXXX")
    trap 'rm -rf "$rootfs"' EXIT
    say "debootstrap $SUITE from $(mirror) (about 100 s)"
    # python3 and pytest (the python toolset's run_tests) for scripts and verify commands;
    # procps for /usr/bin/kill and ps (minbase has only the shell builtin); sh, findutils,
    # grep, coreutils (timeout, sleep) and util-linux (su, unshare, nsenter, ipcrm) come with
    # minbase; sudo is one of the traps.
    debootstrap --variant=minbase --include=python3,python3-pytest,procps,sudo "$SUITE" "$rootfs" \
        "$(mirror)" >"$DIR/debootstrap.log" 2>&1 || {
        say "debootstrap failed, see $DIR/debootstrap.log"
        return 1
    }
    chroot "$rootfs" useradd -u 1000 -m -s /bin/sh runner
    # The traps: each makes uid 1000 root wherever setuid is honoured (tests/unit/agent/
    # test_container_isolation.py checks both that they do and that a sandbox keeps them shut).
    echo 'runner ALL=(ALL:ALL) NOPASSWD: ALL' >"$rootfs/etc/sudoers.d/runner"
    chmod 0440 "$rootfs/etc/sudoers.d/runner"
    chroot "$rootfs" passwd -q -d root
    install -m 4755 "$rootfs/usr/bin/id" "$rootfs/usr/local/bin/suid-id"
    install -d -m 1777 "$rootfs/work" # a tmpfs on /work takes this mode
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/usr/share/doc \
        "$rootfs"/usr/share/man "$rootfs"/usr/share/info "$rootfs"/usr/share/locale \
        "$rootfs"/var/log/*.log "$rootfs"/var/cache/debconf/*-old
    tar -C "$rootfs" -c . | podman import -q \
        --change USER=1000:1000 --change WORKDIR=/work --change "ENV=PATH=$PATHS" \
        --change "LABEL=retrograd.recipe=$RECIPE" --change 'CMD=["sleep","infinity"]' \
        - "$IMAGE" >/dev/null
    rm -rf "$rootfs"
    trap - EXIT
}

smoke() {
    podman run --rm --network=none --read-only --tmpfs /work:rw,exec,size=16m,mode=1777 \
        --user 1000:1000 --cap-drop=ALL --security-opt no-new-privileges --pids-limit=64 \
        -w /work "$IMAGE" sh -c 'python3 -c "import os; print(os.getuid())" &&
            find /work -maxdepth 0 -printf "%m\n" && command -v timeout kill grep ls cat mkdir >/dev/null &&
            command -v sudo su unshare nsenter mount chroot ipcrm >/dev/null && test -u /usr/local/bin/suid-id'
}

install_packages
write_conf
export CONTAINERS_CONF="$CONF"
recipe=$(podman image inspect --format '{{index .Config.Labels "retrograd.recipe"}}' "$IMAGE" \
    2>/dev/null || true)
if [ "$recipe" = "$RECIPE" ] && [ "${RETRO_AGENT_IMAGE_REBUILD:-0}" != 1 ]; then
    say "$IMAGE is there"
    exit 0
fi
build_image
out=$(smoke) || {
    say "the smoke run of $IMAGE failed"
    exit 1
}
[ "$out" = "$(printf '1000\n1777')" ] || {
    say "the smoke run of $IMAGE printed '$out', expected uid 1000 and /work 1777"
    exit 1
}
say "built $IMAGE ($(podman image inspect --format '{{.Size}}' "$IMAGE") bytes)"
