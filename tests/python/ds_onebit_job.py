"""Helper of test_deepspeed_integration.py and test_optim_deepspeed.py (not a test module): trains
a small model on 2 CPU processes (gloo) for 10 steps and prints one JSON line with each rank's
losses, the dense-allreduce flag per step, the number of dense gradient allreduces the engine ran
per step, the sum of |error buffers| and the final parameters.

Modes (all: the same model, data and hyper-parameters: lr 3e-4, freeze_step 2):
  gradcomp   DeepSpeed 0.19.6's OPTIMIZER (OneBitAdam, OneBitLamb or ZeroOneAdam: var_freeze_step
             4, local-step interval doubling every 2 steps up to 2) with gradcomp's OnebitBackend
             put in place of deepspeed.runtime.comm.compressed.CompressedBackend (DS_ACCELERATOR=cpu);
  reference  the same with a pure-torch re-implementation of DeepSpeed's compressed allreduce;
  install    the same with the reference backend at initialize, then gradcomp.deepspeed.install(engine);
  plain      gradcomp.optim's OPTIMIZER (OnebitAdam, OnebitLamb) in a plain loop with torch.distributed;
  ddp        gradcomp.optim's OPTIMIZER under DDP with gradcomp.optim.register_comm_hook;
  client     gradcomp.optim's OPTIMIZER as the client optimizer of whatever DeepSpeed is first on
             sys.path (the test puts 0.19.8 there), bound with gradcomp.deepspeed.install(engine);
  client_torch_adam  torch.optim.Adam as the client optimizer: reports install()'s TypeError.

Usage: python ds_onebit_job.py OPTIMIZER MODE PORT
       python ds_onebit_job.py --batch PORT OPTIMIZER:MODE [OPTIMIZER:MODE ...]
The batch form runs the trainings one after another in the same 2 processes (one spawn, one torch
and DeepSpeed import per rank for all of them; each training builds its model, optimizer and engine
anew, torch.set_num_threads(1) before each) and prints one line per training as soon as both ranks
have finished it, in order: "RESULT OPTIMIZER MODE <json>"; a training that raised on a rank prints
"ERROR OPTIMIZER MODE <json>" and ends the job (exit status 3: the group may be stuck in a
collective; the test reruns the trainings after it in a new job). With DS_ONEBIT_RESULTS=FILE the
lines go to FILE instead (written by this process alone: on the shared stdout, a rank's DeepSpeed
warning can land inside a line longer than the pipe's atomic write of 4096 bytes)."""

import json
import math
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


class ReferenceBackend:
    """docs/contracts.md section 6.1 in plain torch (no gradcomp): DeepSpeed's compressed
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


def data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(16, 16, generator=g)  # one fixed batch per rank: the loss must fall
    y = torch.tanh(x @ torch.randn(16, 1, generator=torch.Generator().manual_seed(5)))
    return x, y


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def gradcomp_optimizer(opt_name, params, **kw):
    import gradcomp.optim as go

    if opt_name == "ZeroOneAdam":
        return go.ZeroOneAdam(params, lr=3e-4, var_freeze_step=4, var_update_scaler=1, local_step_scaler=2,
                              local_step_clipper=2, **kw)
    cls = {"OneBitAdam": go.OnebitAdam, "OneBitLamb": go.OnebitLamb}[opt_name]
    return cls(params, lr=3e-4, freeze_step=2, **kw)


def error_sum(opt):
    err = 0.0
    for st in getattr(opt, "state", {}).values():
        for k in ("worker_error", "server_error"):
            if k in st:
                err += float(st[k].abs().sum())
    for k in ("worker_errors", "server_errors"):  # DeepSpeed's OnebitLamb keeps them on the optimizer
        for t in getattr(opt, k, []) or []:
            err += float(t.abs().sum())
    for k in ("worker_error", "server_error"):  # gradcomp's OnebitLamb
        t = getattr(opt, k, None)
        if isinstance(t, torch.Tensor):
            err += float(t.abs().sum())
    return err


def run_engine(rank, world, opt_name, mode):
    import deepspeed

    model = make_model()
    client = None
    if mode == "client_torch_adam":  # install() must refuse it, naming what to use
        client = torch.optim.Adam(model.parameters(), lr=3e-4)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=client,
                                               config={"train_batch_size": 16 * world,
                                                       "train_micro_batch_size_per_gpu": 16})
        from gradcomp.deepspeed import install

        try:
            install(engine)
        except TypeError as e:
            return {"install_error": str(e), "deepspeed": deepspeed.__version__}
        return {"install_error": None, "deepspeed": deepspeed.__version__}
    if mode == "client":
        client = gradcomp_optimizer(opt_name, model.parameters())
        cfg = {"train_batch_size": 16 * world, "train_micro_batch_size_per_gpu": 16, "gradient_clipping": 0.0}
    else:
        import deepspeed.runtime.comm.compressed as dsc

        if mode == "gradcomp":
            from gradcomp.deepspeed import OnebitBackend
            dsc.CompressedBackend = OnebitBackend
        else:
            dsc.CompressedBackend = ReferenceBackend
        # no gradient clipping (DeepSpeed's default clips to norm 1.0), so that the runs compare
        # with gradcomp.optim's in a plain loop
        cfg = {"train_batch_size": 16 * world, "train_micro_batch_size_per_gpu": 16, "gradient_clipping": 0.0,
               "optimizer": {"type": opt_name,
                             "params": ({"lr": 3e-4, "var_freeze_step": 4, "var_update_scaler": 1,
                                         "local_step_scaler": 2, "local_step_clipper": 2,
                                         "comm_backend_name": "compressed"}
                                        if opt_name == "ZeroOneAdam" else
                                        {"lr": 3e-4, "freeze_step": 2, "comm_backend_name": "compressed"})}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                           optimizer=client)
    if mode in ("install", "client"):
        from gradcomp.deepspeed import install

        install(engine)
    calls = [0]
    inner = engine.allreduce_gradients

    def counted(*a, **k):
        calls[0] += 1
        return inner(*a, **k)

    engine.allreduce_gradients = counted
    x, y = data(rank)
    losses, allreduce, dense_calls = [], [], []
    for _ in range(int(os.environ.get("JOB_STEPS", "10"))):
        calls[0] = 0
        loss = (engine(x) - y).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        allreduce.append(bool(engine.enable_backward_allreduce))
        dense_calls.append(calls[0])
    return model, engine.optimizer, losses, allreduce, dense_calls, deepspeed.__version__


def run_torch(rank, world, opt_name, mode):
    import gradcomp.optim as go

    model = make_model()
    net = model
    if mode == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = gradcomp_optimizer(opt_name, net.parameters())
        go.register_comm_hook(net, opt)
    else:
        opt = gradcomp_optimizer(opt_name, model.parameters())
    x, y = data(rank)
    losses, allreduce, dense_calls = [], [], []
    for _ in range(int(os.environ.get("JOB_STEPS", "10"))):
        opt.zero_grad()
        dense = opt.dense_next
        loss = (net(x) - y).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        allreduce.append(opt.dense_next)
        dense_calls.append(int(dense))
    return model, opt, losses, allreduce, dense_calls, None


def run_one(rank, world, opt_name, mode):
    """One training on the initialized group: the result record of this rank."""
    torch.set_num_threads(1)
    if mode in ("plain", "ddp"):
        model, opt, losses, allreduce, dense_calls, version = run_torch(rank, world, opt_name, mode)
    else:
        if mode == "client_torch_adam":
            return dict(run_engine(rank, world, opt_name, mode), rank=rank)
        model, opt, losses, allreduce, dense_calls, version = run_engine(rank, world, opt_name, mode)
    stats = opt.comm_stats() if hasattr(opt, "comm_stats") else None
    return {"rank": rank, "losses": losses, "allreduce": allreduce, "dense_calls": dense_calls,
            "error_sum": error_sum(opt), "deepspeed": version, "optimizer": type(opt).__name__,
            "comm_stats": stats,
            "params": [v for p in model.parameters() for v in p.detach().reshape(-1).tolist()]}


def worker(rank, world, port, configs, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    i = 0
    try:
        if all(mode in ("plain", "ddp") for _, mode in configs):
            dist.init_process_group("gloo", rank=rank, world_size=world)
        else:
            import deepspeed
            import deepspeed.comm.torch  # noqa: F401 (deepspeed.comm.torch, the attribute, is torch itself)

            # DeepSpeed's shared-memory op serves only inference_all_reduce (tensor-parallel
            # inference), which no training here calls; init_distributed JIT-compiles it (~40 s of
            # C++ on 2 cores, again whenever the other DeepSpeed version built it last: both use
            # one cache folder): left out
            sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
            deepspeed.init_distributed(dist_backend="gloo")
        for i, (opt_name, mode) in enumerate(configs):
            q.put((i, run_one(rank, world, opt_name, mode)))
    except BaseException as e:  # the parent prints it
        import traceback

        q.put((i, {"rank": rank, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}))
        raise


def emit(kind, opt_name, mode, payload):
    """One RESULT / ERROR line: to $DS_ONEBIT_RESULTS when set (appended, flushed), else stdout."""
    line = f"{kind} {opt_name} {mode} " + json.dumps(payload) + "\n"
    path = os.environ.get("DS_ONEBIT_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(line)
    else:
        sys.stdout.write(line)
        sys.stdout.flush()


def main(configs, port):
    """Runs ``configs`` [(optimizer, mode)] on 2 spawned ranks; prints RESULT / ERROR lines; exit status."""
    import queue

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 2, port, configs, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    status = 0
    try:
        for i, (opt_name, mode) in enumerate(configs):
            while len(got.get(i, [])) < len(procs):
                try:
                    j, rec = q.get(timeout=300)
                except queue.Empty:
                    emit("ERROR", opt_name, mode, [{"error": "no result within 300 s"}])
                    status = 4
                    return status
                got.setdefault(j, []).append(rec)
                if "error" in rec:  # a rank failed: report what its training said, end the job
                    emit("ERROR", configs[j][0], configs[j][1], [rec])
                    status = 3
                    return status
            res = sorted(got.pop(i), key=lambda d: d["rank"])
            emit("RESULT", opt_name, mode, res)
    finally:
        for p in procs:
            p.join(timeout=60 if status == 0 else 1)
            if p.is_alive():
                p.kill()
    return status


if __name__ == "__main__":
    if sys.argv[1] == "--batch":
        port = int(sys.argv[2])
        configs = [tuple(c.split(":", 1)) for c in sys.argv[3:]]
        sys.exit(main(configs, port))
    opt_name, mode, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rc = main([(opt_name, mode)], port)
    sys.exit(rc)
