// The etcd server, built from the Go module proxy for the test control plane
// (scripts/cluster.sh). etcd publishes no `go install`-able main for v3.6, so this is it.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
