# Sourced by the image scripts: podman as root without a system service, on this kind of
# machine: runc (Debian package), cgroupfs, no default ulimits, vfs storage in the cache.
CACHE="${STOKER_CACHE:-$HOME/.cache/stoker}"
mkdir -p "$CACHE/podman"
cat >"$CACHE/podman/containers.conf" <<CONF
[containers]
default_ulimits = []
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
cat >"$CACHE/podman/storage.conf" <<CONF
[storage]
driver = "vfs"
graphroot = "$CACHE/podman/storage"
runroot = "$CACHE/podman/run"
CONF
export CONTAINERS_CONF="$CACHE/podman/containers.conf"
export CONTAINERS_STORAGE_CONF="$CACHE/podman/storage.conf"
