#!/usr/bin/env bash
# Installs headless Chromium and its WebDriver (Debian packages chromium, chromium-driver)
# for the chat-page browser tests (crates/cli/tests/cli/chat_page.rs). Idempotent: does nothing
# when /usr/bin/chromium and /usr/bin/chromedriver are both present.
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
echo "install-browser: installing chromium and chromium-driver" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
/usr/bin/chromium --version >&2
