"""The training loop of the real-pod tests, run in a trainer pod: `stoker.Loader` through the
pipeline's headless Service (cluster DNS), a fixed step time standing for the model, the
client's /metrics for the operator to scrape, and one JSON line per batch (its epoch, sample
ids, worker and the loader's wait and step seconds so far) for the test to check. Epochs go on
until the file STOP exists at the end of one.

    python trainer.py WORKERS LOG STEP_SECONDS PIPELINE STOP
"""

import json
import os
import sys
import time

import stoker


def main() -> None:
    workers, log_path, step_s, pipeline, stop = sys.argv[1:6]
    # TLS: the pipeline's CA from its ConfigMap, mounted, named by $STOKER_TLS_CA; the name
    # checked is the Service's (docs/security.md).
    loader = stoker.Loader(workers, rank=0, world_size=1, metrics_port=9400, pipeline=pipeline)
    with open(log_path, "a", buffering=1) as log:
        epoch = 0
        while True:
            for batch in loader:  # one epoch
                stats = loader.stats()
                log.write(json.dumps({
                    "epoch": epoch, "per_epoch": len(loader), "ids": list(batch.sample_ids),
                    "skipped": [i for i, _ in batch.skipped], "worker": batch.worker,
                    "wait_s": stats["wait_s"], "step_s": stats["step_s"], "t": time.time(),
                }) + "\n")
                time.sleep(float(step_s))
            epoch += 1
            if os.path.exists(stop):
                break


if __name__ == "__main__":
    main()
