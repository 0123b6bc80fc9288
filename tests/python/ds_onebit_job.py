"""Helper of test_deepspeed_integration.py (not a test module): trains a small model with
DeepSpeed 0.19.6's OneBitAdam, OneBitLamb (freeze_step 2) or ZeroOneAdam (var_freeze_step 4,
local-step interval doubling every 2 steps up to 2) on 2 CPU processes (gloo, DS_ACCELERATOR=cpu) with a
1-bit backend put in place of deepspeed.runtime.comm.compressed.CompressedBackend, and prints one
JSON line with each rank's losses, the engine's backward-allreduce flag per step, the sum of |error
buffers| and the final parameters.

Usage: python ds_onebit_job.py OPTIMIZER BACKEND PORT   (BACKEND: gradcomp | reference)"""

import json
import math
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


class ReferenceBackend:
    """reference/deepspeed.md section 1.2 in plain torch (no gradcomp): DeepSpeed's compressed
    allreduce, step for step, with dense collectives standing in for the packed bits."""

    def __init__(self, mpu=None):
        self.size = dist.get_world_size()
        self.rank = dist.get_rank()

    @staticmethod
    def sign(x):
        return (torch.sign(x) + 1).bool().float() * 2 - 1  # +1 for +-0.0 and NaN

    def compressed_allreduce(self, buffer_m, worker_error, server_error, local_rank):
        W, r = self.size, self.rank
        shape, n = buffer_m.shape, buffer_m.numel()
        Np = worker_error.numel()
        buf = torch.zeros(Np)
        buf[:n] = buffer_m.reshape(-1)
        buf += worker_error
        s = torch.norm(buf) / math.sqrt(Np)
        sg = self.sign(buf)
        worker_error.copy_(buf - s * sg)
        C = Np // W
        signs = [torch.empty(Np) for _ in range(W)]
        dist.all_gather(signs, sg)
        scales = [torch.empty(1) for _ in range(W)]
        dist.all_gather(scales, s.reshape(1))
        comp = torch.stack([signs[j][r * C:(r + 1) * C] * (scales[j] * (1.0 / W)) for j in range(W)]).sum(0)
        comp += server_error
        ss = torch.norm(comp) / math.sqrt(C)
        ssg = self.sign(comp)
        server_error.copy_(comp - ss * ssg)
        outs = [torch.empty(C) for _ in range(W)]
        dist.all_gather(outs, ssg * ss)
        out = torch.cat(outs)
        if n == Np:
            buffer_m.copy_(out.reshape(shape))
            return buffer_m
        return out[:n].reshape(shape)


def worker(rank, world, port, opt_name, backend, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.runtime.comm.compressed as dsc

    if backend == "gradcomp":
        from gradcomp.deepspeed import OnebitBackend
        dsc.CompressedBackend = OnebitBackend
    else:
        dsc.CompressedBackend = ReferenceBackend
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    cfg = {"train_batch_size": 16 * world, "train_micro_batch_size_per_gpu": 16,
           "optimizer": {"type": opt_name,
                         "params": ({"lr": 3e-4, "var_freeze_step": 4, "var_update_scaler": 1, "local_step_scaler": 2,
                                     "local_step_clipper": 2, "comm_backend_name": "compressed"}
                                    if opt_name == "ZeroOneAdam" else
                                    {"lr": 3e-4, "freeze_step": 2, "comm_backend_name": "compressed"})}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(16, 16, generator=g)  # one fixed batch per rank: the loss must fall
    y = torch.tanh(x @ torch.randn(16, 1, generator=torch.Generator().manual_seed(5)))
    losses, allreduce = [], []
    for _ in range(10):
        loss = (engine(x) - y).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        allreduce.append(bool(engine.enable_backward_allreduce))
    opt = engine.optimizer
    err = 0.0
    for st in getattr(opt, "state", {}).values():
        for k in ("worker_error", "server_error"):
            if k in st:
                err += float(st[k].abs().sum())
    for k in ("worker_errors", "server_errors"):  # OnebitLamb keeps them on the optimizer
        for t in getattr(opt, k, []) or []:
            err += float(t.abs().sum())
    q.put({"rank": rank, "losses": losses, "allreduce": allreduce, "error_sum": err,
           "params": [v for p in model.parameters() for v in p.detach().reshape(-1).tolist()]})


if __name__ == "__main__":
    opt_name, backend, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 2, port, opt_name, backend, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = sorted((q.get(timeout=300) for _ in procs), key=lambda d: d["rank"])
    for p in procs:
        p.join(timeout=60)
    print("RESULT " + json.dumps(res))
