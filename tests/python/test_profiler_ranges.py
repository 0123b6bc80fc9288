"""gradcomp's phases on a PyTorch profiler trace (gradcomp.torch.stats, "Profiler ranges"): a real
2-rank gloo DDP run with the gradcomp hook under ``torch.profiler.profile`` on the CPU. The trace
holds ``gradcomp.encode[bucket=I]``, ``gradcomp.comm[bucket=I]`` and ``gradcomp.decode[bucket=I]``
for every bucket I of DDP's layout, of positive length, in that order per call, each
communication range holding the start of gloo's own collective and ending when it completed;
without a profiler no range is opened, and on the CPU no NVTX call is made. No numeric tolerance:
the checks are orderings of the profiler's own timestamps."""

import pytest

pytest.importorskip("torch")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from ddp_helpers import ddp, run  # noqa: E402

PHASES = ("encode", "comm", "decode")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


def job_profiled(rank, world, all_threads):
    """Two warm-up steps (DDP rebuilds its buckets after the first), then two profiled steps of
    fp16 under the ``sum`` scheme (one encode, one asynchronous allreduce, one decode in its
    callback per bucket). Returns the gradcomp and gloo events (name, start, end in us, thread),
    the buckets of the layout, and how often NVTX or the range opener was called."""
    import gradcomp.torch as gt
    import gradcomp.torch.stats as gs
    from torch.profiler import ProfilerActivity, profile

    calls = {"nvtx": 0, "open": 0}

    def no_nvtx(*a, **k):
        calls["nvtx"] += 1
        raise AssertionError("an NVTX range on the CPU")

    opener = gs.open_range

    def counted(*a, **k):
        calls["open"] += 1
        return opener(*a, **k)

    saved = torch.cuda.nvtx.range_start, torch.cuda.nvtx.range_push
    torch.cuda.nvtx.range_start = torch.cuda.nvtx.range_push = no_nvtx
    gs.open_range = counted
    try:
        m = ddp(_model(), bucket_cap_mb=0.01)  # 10 kB buckets: several of them
        st = gt.register(m, codec="fp16", scheme="sum", min_compress_numel=0, exempt=())
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)

        def step():
            opt.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()

        for _ in range(2):
            step()
        unprofiled_opens = calls["open"]
        kw = {}
        if all_threads:
            kw["experimental_config"] = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        with profile(activities=[ProfilerActivity.CPU], **kw) as prof:
            for _ in range(2):
                step()
        events = [(e.name, e.time_range.start, e.time_range.end, e.thread) for e in prof.events()
                  if e.name.startswith("gradcomp.") or e.name.startswith("gloo:")]
        buckets = sorted(lay["index"] for lay in st.compressor.layouts())
    finally:
        torch.cuda.nvtx.range_start, torch.cuda.nvtx.range_push = saved
        gs.open_range = opener
    return {"events": events, "buckets": buckets, "nvtx": calls["nvtx"], "unprofiled_opens": unprofiled_opens,
            "opens": calls["open"]}


def _by_bucket(events):
    """{bucket: {phase: [(start, end, thread)] in start order}} of the gradcomp ranges."""
    out = {}
    for name, s, e, th in events:
        if not name.startswith("gradcomp."):
            continue
        phase, _, tag = name[len("gradcomp."):].partition("[")
        assert tag.startswith("bucket=") and tag.endswith("]"), name
        out.setdefault(int(tag[len("bucket="):-1]), {}).setdefault(phase, []).append((s, e, th))
    for d in out.values():
        for v in d.values():
            v.sort()
    return out


def test_three_ranges_per_bucket_all_threads():
    """profile_all_threads: the decodes, which run in the collective's callback (gloo's worker
    thread, or the calling thread when the collective completed first), are on the trace too."""
    for r, res in enumerate(run(2, job_profiled, True)):
        assert res["nvtx"] == 0, "no NVTX call on the CPU"
        assert res["unprofiled_opens"] == 0, "no range is opened while no profiler records"
        by = _by_bucket(res["events"])
        assert len(res["buckets"]) >= 2 and sorted(by) == res["buckets"], (by.keys(), res["buckets"])
        gloo = sorted((s, e) for n, s, e, _ in res["events"] if n.startswith("gloo:all_reduce"))
        for b, ph in by.items():
            assert sorted(ph) == sorted(PHASES), (r, b, ph.keys())
            assert [len(ph[p]) for p in PHASES] == [2, 2, 2], (r, b)  # two profiled steps
            for k in range(2):
                (es, ee, eth), (cs, ce, cth), (ds, de, _) = (ph[p][k] for p in PHASES)
                assert ee > es and ce > cs and de > ds, (r, b, k)  # durations > 0
                # encode, then the collective from its launch to its completion, then the decode
                assert ee <= cs and ce <= ds, (r, b, k, (es, ee), (cs, ce), (ds, de))
                assert eth == cth, "encode and launch in the calling thread"
                # the range holds gloo's own allreduce of the payload: it starts inside it
                assert any(cs <= gs_ <= ce for gs_, _ in gloo), (r, b, k)
        # one bucket's phases do not overlap another's encode: DDP calls the hook bucket by bucket
        encodes = sorted(x for ph in by.values() for x in ph["encode"])
        assert all(a[1] <= b[0] for a, b in zip(encodes, encodes[1:]))


def test_default_profiler_records_encode_and_comm():
    """The default profiler records the calling thread: every bucket's encode and communication
    range, the latter ending at the completion of the collective (in the callback thread)."""
    for r, res in enumerate(run(2, job_profiled, False)):
        assert res["nvtx"] == 0 and res["unprofiled_opens"] == 0
        assert res["opens"] > 0
        by = _by_bucket(res["events"])
        assert sorted(by) == res["buckets"]
        for b, ph in by.items():
            assert len(ph["encode"]) == 2 and len(ph["comm"]) == 2, (r, b, ph.keys())
            for (es, ee, _), (cs, ce, _) in zip(ph["encode"], ph["comm"]):
                assert es < ee <= cs < ce, (r, b)
