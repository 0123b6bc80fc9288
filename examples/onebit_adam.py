"""1-bit Adam (gradcomp.optim.OnebitAdam) next to dense Adam on 2 CPU processes.

Run from the repository root (after ``bash tests/setup.sh``):

    .venv/bin/torchrun --standalone --nproc_per_node=2 examples/onebit_adam.py

Each rank trains the same tanh MLP (64 -> 256 -> 256 -> 10) on its half of scikit-learn's digits
(1397 training images, 400 held out) twice, with the same seed: once with torch.optim.Adam under
plain DDP (every step allreduces the float32 gradients), once with gradcomp.optim.OnebitAdam
under DDP with gradcomp.optim.register_comm_hook (a dense warm-up of ``--freeze-step`` steps,
then only the 1-bit compressed momentum travels: DeepSpeed's error-compensated compressed
allreduce, Tang et al., "1-bit Adam", ICML 2021). Rank 0 prints the training loss every
``--every`` steps for both, then the test accuracy and the bytes each rank sent per step
(gradcomp.planner's formulas: a ring allreduce sends 2 (W-1)/W of the gradient bytes).

Exact zeros in a gradient are what 1-bit Adam cannot carry: its momentum becomes +-scale where the
frozen variance is 0, and m / (sqrt(v) + eps) explodes. The example therefore masks the first
layer's weights of constant pixels with ``exp_avg_mask`` (DeepSpeed's remedy) and uses tanh, whose
units do not die (dead ReLU units have zero gradients too: with ReLU this run diverges).

Options: --steps (default 300), --freeze-step (default 45, 15 % of the steps as DeepSpeed's
tutorial advises), --lr (1e-3), --batch (per rank, 32), --every (25).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import gradcomp.optim as go
from gradcomp import planner


def data(rank, world):
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x, y = d.data.astype(np.float32), d.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=400, random_state=0, stratify=y)
    mu, sd = xtr.mean(0), xtr.std(0) + 1.0
    xtr, xte = (xtr - mu) / sd, (xte - mu) / sd
    live = torch.from_numpy(xtr.std(0) > 0)  # pixels that are not constant over the training set
    t = [torch.from_numpy(a) for a in (xtr, ytr, xte, yte)]
    return t[0][rank::world], t[1][rank::world], t[2], t[3], live


def train(kind, a, rank, world):
    xtr, ytr, xte, yte, live = data(rank, world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                                torch.nn.Tanh(), torch.nn.Linear(256, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if kind == "Adam":
        opt = torch.optim.Adam(ddp.parameters(), lr=a.lr)
    else:
        # The first layer's weights of constant pixels get exact zero gradients forever; 1-bit
        # signs cannot send a zero, so without a mask their momentum would become +-scale while
        # their variance is 0, and m / (sqrt(v) + eps) would explode: DeepSpeed's exp_avg_mask.
        first = model[0].weight
        mask = live.to(first.dtype).expand_as(first).clone()
        rest = [p for p in ddp.parameters() if p is not first]
        opt = go.OnebitAdam([{"params": [first], "exp_avg_mask": mask}, {"params": rest}], lr=a.lr,
                            freeze_step=a.freeze_step)
        go.register_comm_hook(ddp, opt)
    g = torch.Generator().manual_seed(1 + rank)
    losses = []
    for step in range(1, a.steps + 1):
        idx = torch.randint(0, xtr.shape[0], (a.batch,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(xtr[idx]), ytr[idx])
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t) / world)
    with torch.no_grad():
        acc = 100.0 * float((model(xte).argmax(1) == yte).float().mean())
    if kind == "Adam":
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        per_step = planner.ring_allreduce_bytes(grad_bytes, world)
    else:
        per_step = opt.comm_stats()["sent_bytes_per_step"]
    return losses, acc, per_step


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--freeze-step", type=int, default=45)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--every", type=int, default=25)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    res = {k: train(k, a, rank, world) for k in ("Adam", "OnebitAdam")}
    if rank == 0:
        print(f"world size {world}, {a.steps} steps, OnebitAdam freeze_step {a.freeze_step}")
        print(f"{'step':>6} {'Adam loss':>10} {'1-bit Adam loss':>16}")
        for s in range(a.every, a.steps + 1, a.every):
            print(f"{s:>6} {res['Adam'][0][s - 1]:>10.4f} {res['OnebitAdam'][0][s - 1]:>16.4f}")
        print(f"{'':>6} {'Adam':>10} {'1-bit Adam':>16}")
        print(f"{'test accuracy %':>16} {res['Adam'][1]:>.2f} {res['OnebitAdam'][1]:>16.2f}")
        print(f"{'bytes sent per step per rank':>28}: Adam {res['Adam'][2]:.0f}, 1-bit Adam "
              f"{res['OnebitAdam'][2]:.0f} ({res['Adam'][2] / res['OnebitAdam'][2]:.1f}x less)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
