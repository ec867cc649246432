"""Horovod elastic with `DADOptimizer`: a worker leaves, then one joins (localhost, gloo).

Usage: horovodrun --gloo -np 2 --min-np 1 --max-np 2 --host-discovery-script DISCOVER \
           python elastic_horovod_worker.py OUT HOSTS_FILE

DISCOVER prints HOSTS_FILE, which rank 0 rewrites: ``localhost:1`` after step SHRINK_AT, and
``localhost:2`` once it trained AT_ONE steps on one process. The job trains two models with the
documented pattern (``hvd.elastic.run``, ``hvd.elastic.TorchState(model=..., optimizer=...)``,
``state.commit()`` every step): "exact" (dAD lossless) checks each step's synchronised gradient
against Horovod's own all-reduce (op Average) of the same local gradients at the size of the moment;
"rank" (rank-dAD with error feedback) trains on. Rank 0 writes the log of every step (size, error,
losses) and whether all ranks end with equal parameters.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from resume_worker import MODEL, batch, flat_params  # noqa: E402

SHRINK_AT, AT_ONE, AT_TWO_AGAIN, MAX_STEPS = 2, 3, 3, 80


def main() -> None:
    out_path, hosts_file = sys.argv[1], sys.argv[2]
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("horovod_dad.elastic").setLevel(logging.INFO)
    torch.set_num_threads(1)
    import horovod.torch as hvd
    from horovod_dad import DADOptimizer
    hvd.init()

    def dad_pair(config: dict, seed: int):
        model = models.build(MODEL, seed=seed)
        opt = DADOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                           named_parameters=model.named_parameters(), model=model, dad=config)
        return model, opt

    model, opt = dad_pair({"mode": "auto"}, 0)
    model_r, opt_r = dad_pair({"mode": "rank", "rank": 2, "error_feedback": True}, 1)
    twin = models.build(MODEL)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, model_r=model_r, optimizer_r=opt_r,
                                   batch=0, log=[], phase="two")

    def hosts(text: str) -> None:
        with open(hosts_file + ".tmp", "w") as f:
            f.write(text + "\n")
        os.replace(hosts_file + ".tmp", hosts_file)

    @hvd.elastic.run
    def train(state) -> None:
        while state.batch < MAX_STEPS:
            step, size = state.batch, hvd.size()
            data = batch(step, hvd.rank())
            # as Horovod's examples do: a step cut short by a departed worker left its gradients
            opt.zero_grad()
            opt_r.zero_grad()
            # Horovod's own result: the local gradients of a copy, all-reduced with op Average
            twin.load_state_dict(model.state_dict())
            twin.zero_grad(set_to_none=True)
            models.loss_of(MODEL, twin, data).backward()
            ref = torch.cat([hvd.allreduce(p.grad, op=hvd.Average, name=f"ref.{i}").reshape(-1)
                             for i, p in enumerate(twin.parameters())])
            loss = models.loss_of(MODEL, model, data)
            loss.backward()
            opt.synchronize()
            mine = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            err = float((mine - ref).norm() / ref.norm())
            with opt.skip_synchronize():
                opt.step()
            opt.zero_grad()
            loss_r = models.loss_of(MODEL, model_r, data)
            loss_r.backward()
            opt_r.step()
            opt_r.zero_grad()
            state.log.append([step, size, err, float(loss.detach()), float(loss_r.detach())])
            print(f"step {step} rank {hvd.rank()} of {size}: err {err:.2e}", flush=True)
            state.batch += 1
            if hvd.rank() == 0:
                sizes = [s for _, s, *_ in state.log]
                if state.phase == "two" and step + 1 >= SHRINK_AT:
                    state.phase = "shrinking"
                    hosts("localhost:1")
                elif state.phase == "shrinking" and sizes[-AT_ONE:] == [1] * AT_ONE:
                    state.phase = "growing"
                    hosts("localhost:2")
                elif state.phase == "growing" and 1 in sizes and sizes[-AT_TWO_AGAIN:] == [2] * AT_TWO_AGAIN:
                    state.phase = "done"
            state.phase = hvd.broadcast_object(state.phase, root_rank=0, name="phase")  # all stop together
            time.sleep(0.3)  # give the driver's host discovery (every second) time to notice
            state.commit()
            if state.phase == "done":
                break

    train(state)
    finals = hvd.allgather_object([flat_params(model), flat_params(model_r)], name="finals")
    if hvd.rank() == 0:
        same = all(torch.equal(f[0], finals[0][0]) and torch.equal(f[1], finals[0][1]) for f in finals)
        with open(out_path, "w") as f:
            json.dump({"log": state.log, "final_size": hvd.size(), "params_same": same,
                       "finite": all(math.isfinite(x) for row in state.log for x in row[3:])}, f, indent=1)


if __name__ == "__main__":
    main()
