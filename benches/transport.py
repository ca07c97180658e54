"""Transport benchmark: batch payload landing in numpy, three ways, on loopback.

    python benches/transport.py [--batch-mib 64] [--batches 30]

Rows (one run, side by side):
  stoker     the Python package's Loader: frames read once into the buffer the numpy
             arrays view (prefetch 4), from `stoker-lab bench transport-server`;
  stoker TLS the same over TLS 1.3 (the server's `--tls-dir`: a CA and a certificate for
             127.0.0.1 made for the run; the Loader trusts that CA), as the operator's
             workers serve by default;
  tcp bound  plain TCP: the same server sends the same bytes unframed, Python recv_into
             one reused buffer (kernel -> user copy only: the ceiling of any TCP transport);
  mp.Queue   the same arrays pickled through a multiprocessing.Queue between processes (how
             the PyTorch DataLoader's worker processes hand batches over).
"""

import argparse
import multiprocessing as mp
import os
import pathlib
import socket
import struct
import subprocess
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]


def start_server(stoker_bin, batch_mib, tls_dir=None):
    """The server, its address, the payload's size and (with `tls_dir`) the CA to trust."""
    tls = ["--tls-dir", str(tls_dir)] if tls_dir else []
    proc = subprocess.Popen(
        [stoker_bin, "bench", "transport-server", "--batch-mib", str(batch_mib), *tls],
        stdout=subprocess.PIPE, text=True,
    )
    size = int(proc.stdout.readline().split()[1])
    addr = proc.stdout.readline().split()[1]
    ca = proc.stdout.readline().split()[1] if tls_dir else None
    return proc, addr, size, ca


def bench_stoker(addr, batches, ca=None):
    import stoker

    dial = dict(tls_ca=ca) if ca else dict(insecure_plaintext=True)
    loader = stoker.Loader(addr, prefetch=4, hedge=False, **dial)
    for _ in range(3):
        next(loader)
    nbytes = 0
    t = time.perf_counter()
    for _ in range(batches):
        b = next(loader)
        nbytes += sum(a.nbytes for a in b.tensors.values())
    return nbytes, time.perf_counter() - t


def bench_tcp(addr, size, batches):
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    s.sendall(b"RAW " + struct.pack("<Q", batches + 3))
    buf = bytearray(size)
    view = memoryview(buf)

    def recv_one():
        got = 0
        while got < size:
            n = s.recv_into(view[got:], size - got)
            if n == 0:
                raise EOFError("server closed")
            got += n

    for _ in range(3):
        recv_one()
    t = time.perf_counter()
    for _ in range(batches):
        recv_one()
    return size * batches, time.perf_counter() - t


def arrays_like(batch_mib):
    b, l, dim = 8, 1024, 3 * 2 * 14 * 14
    rows = max(1, (batch_mib << 20) // (dim * 4))
    ids = np.arange(b * l, dtype=np.int64).reshape(b, l)
    return {
        "input_ids": ids,
        "labels": ids.copy(),
        "attention_mask": ids.copy(),
        "pixel_values": np.random.default_rng(0).random((rows, dim), dtype=np.float32),
        "image_grid_thw": np.array([[1, 2, rows // 2]], dtype=np.int64),
    }


def _producer(q, batch_mib, n):
    arrays = arrays_like(batch_mib)
    for _ in range(n):
        q.put(arrays)


def bench_mp_queue(batch_mib, batches):
    q = mp.Queue(maxsize=4)
    p = mp.Process(target=_producer, args=(q, batch_mib, batches + 3))
    p.start()
    for _ in range(3):
        q.get()
    nbytes = 0
    t = time.perf_counter()
    for _ in range(batches):
        nbytes += sum(a.nbytes for a in q.get().values())
    dt = time.perf_counter() - t
    p.join()
    return nbytes, dt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-mib", type=int, default=64)
    ap.add_argument("--batches", type=int, default=30)
    ap.add_argument("--stoker-bin", default=os.environ.get("STOKER_LAB", str(REPO / "target/release/stoker-lab")),
                    help="the lab binary (its `bench transport-server`)")
    a = ap.parse_args()
    import tempfile
    with tempfile.TemporaryDirectory() as tls_dir:
        proc, addr, size, _ = start_server(a.stoker_bin, a.batch_mib)
        tls_proc, tls_addr, _, ca = start_server(a.stoker_bin, a.batch_mib, tls_dir)
        try:
            rows = [
                ("stoker Loader -> numpy views", bench_stoker(addr, a.batches)),
                ("plain TCP recv_into (bound)", bench_tcp(addr, size, a.batches)),
                ("pickle via multiprocessing.Queue", bench_mp_queue(a.batch_mib, a.batches)),
                ("stoker Loader, TLS 1.3", bench_stoker(tls_addr, a.batches, ca)),
            ]
        finally:
            proc.kill()
            tls_proc.kill()
    bound = rows[1][1][0] / rows[1][1][1]
    print(f"Transport on loopback: {a.batches} batches of {size / 2**20:.1f} MiB, {os.cpu_count()} cores")
    print(f"{'transport':<34} {'GB/s':>7} {'of TCP bound':>13}")
    for name, (nbytes, dt) in rows:
        rate = nbytes / dt
        print(f"{name:<34} {rate / 1e9:>7.2f} {100 * rate / bound:>12.0f} %")
    ours, pickled = rows[0][1][0] / rows[0][1][1], rows[2][1][0] / rows[2][1][1]
    tls = rows[3][1][0] / rows[3][1][1]
    print(f"stoker / TCP bound: {100 * ours / bound:.0f} % (target >= 70 %); stoker / mp.Queue: {ours / pickled:.1f}x; "
          f"TLS / plaintext: {tls / ours:.2f}x")


if __name__ == "__main__":
    main()
