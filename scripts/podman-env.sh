# Sourced by the image scripts: podman as root without a system service, on this kind of
# machine: runc (Debian package), cgroupfs, no default ulimits, vfs storage in the cache.
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
mkdir -p "$STOKER_CACHE/podman"
cat >"$STOKER_CACHE/podman/containers.conf" <<CONF
[containers]
default_ulimits = []
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
cat >"$STOKER_CACHE/podman/storage.conf" <<CONF
[storage]
driver = "vfs"
graphroot = "$STOKER_CACHE/podman/storage"
runroot = "$STOKER_CACHE/podman/run"
CONF
export CONTAINERS_CONF="$STOKER_CACHE/podman/containers.conf"
export CONTAINERS_STORAGE_CONF="$STOKER_CACHE/podman/storage.conf"
