"""DeepSpeed (ZeRO-3) fed by Stoker (docs/client.md, "With your trainer").

    deepspeed --num_gpus 8 examples/deepspeed_train.py --workers dns:my-pipeline-workers.ns.svc:7700 \
        --model Qwen/Qwen2-VL-2B-Instruct --config ds_zero3.json --save-dir ckpt --steps 1000 [--resume]

The loader is not handed to `deepspeed.initialize` (no `training_data`): DeepSpeed would wrap
it in a DistributedSampler over a dataset, while each rank's loader already reads its own slice
of every global batch. ZeRO shards parameters, gradients and optimizer state, not data, so
every rank is a data-parallel rank (RANK, WORLD_SIZE). One Stoker batch is one micro-batch
(`train_micro_batch_size_per_gpu` = Stoker's global batch / world size). The loader's state
rides in each DeepSpeed checkpoint (`client_state`), so `--resume` continues exactly, at any
world size. tests/parity/test_deepspeed.py runs `train` on two processes on the CPU.
"""

import argparse

import deepspeed

import stoker
import stoker.torch


def train(workers, model, optimizer, config, steps, save_dir, save_steps, resume=False, on_step=None):
    loader = stoker.Loader(workers)  # rank and world size from the launcher's RANK, WORLD_SIZE
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)  # no training_data
    if resume:
        _, client_state = engine.load_checkpoint(save_dir)
        loader.load_state_dict(client_state["stoker"])
    image_token = model.config.image_token_id
    while engine.global_steps < steps:
        for batch in loader:  # one epoch; the while loop goes on into the next
            inputs = stoker.torch.model_inputs(batch, engine.device, image_token_id=image_token)
            loss = engine(**inputs).loss
            engine.backward(loss)
            engine.step()
            if on_step is not None:
                on_step(engine.global_steps, batch, loss)
            if engine.global_steps % save_steps == 0:
                engine.save_checkpoint(save_dir, client_state={"stoker": loader.state_dict()})
            if engine.global_steps == steps:
                break
    return engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", required=True, help="dns:HOST:PORT or HOST:PORT,HOST:PORT")
    p.add_argument("--model", required=True, help="a Qwen-VL checkpoint (Hub id or folder)")
    p.add_argument("--config", required=True, help="a DeepSpeed config (JSON), ZeRO stage 3")
    p.add_argument("--save-dir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-steps", type=int, default=500)
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --save-dir")
    a = p.parse_args()
    import torch
    from transformers import AutoModelForImageTextToText

    deepspeed.init_distributed()
    model = AutoModelForImageTextToText.from_pretrained(a.model, dtype="auto")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    train(a.workers, model, optimizer, a.config, a.steps, a.save_dir, a.save_steps, resume=a.resume)


if __name__ == "__main__":
    main()
