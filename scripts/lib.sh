# Sourced by every script here: the cache outside the repository (STOKER_CACHE), the one cargo
# target directory inside it (a fresh clone reuses the builds; every script builds with the
# same features, so cargo never rebuilds a dependency for another selection), and Debian
# package installs, as root or through sudo.
export STOKER_CACHE="${STOKER_CACHE:-$HOME/.cache/stoker}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$STOKER_CACHE/target}"

# The pod sandbox ("pause") image of the test cluster's real nodes: built by
# scripts/setup-k8s-tools.sh, imported by scripts/cluster.sh.
export STOKER_PAUSE_IMAGE=localhost/stoker-pause:1
export STOKER_PAUSE_ARCHIVE="$STOKER_CACHE/image/stoker-pause-1.tar"

# apt_install PACKAGE...: installs them quietly (one `apt-get update` first).
apt_install() {
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}
