#!/bin/sh
# Set up headless Chromium for the tests of the web pages (tests/factories/browser.py drives it
# over the DevTools protocol: the run server's page and the rollout viewer).
#   1. a browser on PATH: chromium, chromium-browser, google-chrome or google-chrome-stable;
#   2. where none is, Debian's chromium package through apt-get (as root, or with a sudo that
#      asks no password);
#   3. a smoke run: the browser renders a page headless, as the tests start it.
# Idempotent: under two seconds when the browser is there. Exits non-zero, saying why, when it
# cannot (the browser tests then fail, naming this script).
set -eu

BROWSERS="chromium chromium-browser google-chrome google-chrome-stable"

say() { echo "browser: $*" >&2; }

find_browser() {
    for name in $BROWSERS; do
        if command -v "$name" >/dev/null 2>&1; then
            command -v "$name"
            return 0
        fi
    done
    return 1
}

# The command that runs apt-get with root's rights here, or nothing when there is none.
as_root() {
    if [ "$(id -u)" = 0 ]; then
        echo env
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        echo sudo
    fi
}

install_chromium() {
    if ! command -v apt-get >/dev/null 2>&1; then
        say "none of $BROWSERS is on PATH and there is no apt-get to install one:"
        say "install Chromium with the system's package manager"
        return 1
    fi
    root=$(as_root)
    if [ -z "$root" ]; then
        say "none of $BROWSERS is on PATH; installing chromium needs root (or a sudo that asks"
        say "no password): sudo apt-get install -y chromium"
        return 1
    fi
    say "installing chromium with apt-get (about a minute)"
    $root apt-get update -qq
    $root DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
}

# The browser renders a page headless with the flags the tests give it.
smoke() {
    profile=$(mktemp -d)
    out=$(HOME=$profile timeout 120 "$1" --headless --no-sandbox --disable-gpu \
        --disable-dev-shm-usage --no-first-run --user-data-dir="$profile" \
        --dump-dom 'data:text/html,<p>retrograd</p>' 2>"$profile.log") || true
    case $out in
    *"<p>retrograd</p>"*) rm -rf "$profile" "$profile.log" ;;
    *)
        say "$1 did not render a page headless; its log:"
        tail -n 20 "$profile.log" >&2
        rm -rf "$profile" "$profile.log"
        return 1
        ;;
    esac
}

browser=$(find_browser) || {
    install_chromium
    browser=$(find_browser) || {
        say "apt-get installed chromium, yet none of $BROWSERS is on PATH"
        exit 1
    }
}
smoke "$browser"
say "$browser is there ($("$browser" --version 2>/dev/null || echo 'version unknown'))"
