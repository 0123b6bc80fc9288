"""gradcomp-bench (gradcomp.bench): the CLI run on tiny sizes (2^12, 2^14, one rep) into a tmp dir,
checked for its files and for the values it derives (packet and compulsory bytes, floor and fraction
of floor) against formulas written here; load() on bad files; throughput() on hand-made tables; the
torch baselines against the codecs' own decode and residual (bitwise, except onebit, whose scale
torch's norm sums in another order: decode rtol 4e-6 into float32 and one bfloat16 ulp (8e-3) into
bfloat16, residual atol 1e-5 with |s| < 1; and bfloat16 top-k, where ties at the threshold may pick
other indices: the same magnitudes). No timing is asserted."""

import copy
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")

import gradcomp  # noqa: E402
from gradcomp import bench  # noqa: E402
from gradcomp.bench import baselines  # noqa: E402
from gradcomp.bench.__main__ import main  # noqa: E402

SIZES = (12, 14)
DTYPES = ("float32", "bfloat16")
ELEM = {"float32": 4, "bfloat16": 2}  # bytes per input element
EF_NAMES = set(baselines.EF_CODECS)  # the codecs gradcomp-bench runs with error feedback too
# names with a torch sequence written in gradcomp.bench.baselines (test_baselines_cover_the_registry:
# every registered codec)
KNOWN = set(baselines.CODECS)
# deterministic codecs whose baseline must reproduce the packet's information (at least one spec
# of every deterministic registered codec: test_exact_covers_every_deterministic_codec)
EXACT = ["none", "fp16", "bf16", "topk:ratio=0.01", "fp8", "fp8:format=e5m2", "fp8:scale=e8m0", "fp8:block=0",
         "int8", "int8:block=0", "int4", "int4:block=0", "onebit", "onebit:scale=mean_abs", "onebit:chunk=256"]


def _expected_specs():
    out = set()
    for c in gradcomp.codecs():
        try:
            out.add(gradcomp.Codec(c["name"]).spec)
        except gradcomp.InvalidArgumentError:
            out.add(gradcomp.Codec(c["examples"][0]).spec)
    out |= {"topk:ratio=0.01", "qsgd:levels=16", "qsgd:levels=16,coding=elias", "int8:integrity=crc32c"}
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    import contextlib
    import io

    buf = io.StringIO()
    before = (gradcomp.get_num_threads(), torch.get_num_threads())
    with contextlib.redirect_stdout(buf):
        rc = main(["--sizes", *map(str, SIZES), "--reps", "1", "--threads", "1", "--out", str(out)])
    assert rc == 0
    assert (gradcomp.get_num_threads(), torch.get_num_threads()) == before  # restored after the run
    return out, buf.getvalue(), bench.load(out / "bench_cpu.json")


def test_elias_line(run):
    """The Elias-coded QSGD row says its stream's bits per element (randn input, s = 16: most codes
    are small non-zero levels, so between 2 and 8 bits) and its throughput in elements/s."""
    _, stdout, _ = run
    lines = [ln for ln in stdout.splitlines() if ln.strip().startswith("qsgd:levels=16,coding=elias: stream")]
    assert len(lines) == len(SIZES) * 2, lines  # one per size and dtype
    for ln in lines:
        bits = float(ln.split("stream ")[1].split(" bits")[0])
        assert 2.0 < bits < 8.0, ln
        assert "M elements/s encode" in ln and "M elements/s decode" in ln


def test_files_and_header(run):
    out, stdout, table = run
    png = (out / "bench_cpu.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert (out / "bench_cpu.txt").read_text().strip() in stdout
    with open(out / "bench_cpu.json") as f:
        raw = json.load(f)
    assert raw == table
    assert table["format"] == "gradcomp-bench/1"
    assert table["device"] == "cpu" and table["threads"] == 1
    assert table["torch"] == torch.__version__
    assert table["gradcomp"] == gradcomp.build_info()["version"]
    assert table["date"][:4].isdigit() and table["date"][4] == "-"
    assert table["copy_bytes_per_s"] == max(c["bytes_per_s"] for c in table["copies"])
    for col in ("kernel", "ms", "GB/s", "of copy", "baseline", "speedup"):
        assert col in stdout
    for spec in _expected_specs():
        assert f"\n{spec} encode " in stdout and f"\n{spec} decode " in stdout
        if spec.split(":")[0] in EF_NAMES:
            assert f"\n{spec} +ef encode " in stdout


def test_every_codec_dtype_size(run):
    _, _, table = run
    specs = _expected_specs()
    assert {c["name"] for c in gradcomp.codecs()} == {s.split(":")[0] for s in specs}
    seen = {}
    for r in table["rows"]:
        key = (r["codec"], r["dtype"], r["numel"], r["error_feedback"])
        assert key not in seen, key
        seen[key] = r
    want = set()
    for spec in specs:
        for d in DTYPES:
            for s in SIZES:
                want.add((spec, d, 1 << s, False))
                if spec.split(":")[0] in EF_NAMES:
                    want.add((spec, d, 1 << s, True))
    assert set(seen) == want


def test_derived_values(run):
    _, _, table = run
    copies = {(c["dtype"], c["numel"]): c for c in table["copies"]}
    assert set(copies) == {(d, 1 << s) for d in DTYPES for s in SIZES}
    for c in copies.values():
        assert c["bytes_per_s"] == pytest.approx(2 * c["numel"] * ELEM[c["dtype"]] / c["copy_s"], rel=1e-12)
    for r in table["rows"]:
        n, d = r["numel"], r["dtype"]
        pb = gradcomp.Codec(r["codec"]).packet_bytes(n, d)
        assert r["packet_bytes"] == pb
        assert r["encode_bytes"] == n * ELEM[d] + pb + (8 * n if r["error_feedback"] else 0)
        assert r["decode_bytes"] == pb + n * ELEM[d]
        assert r["copy_bytes_per_s"] == copies[(d, n)]["bytes_per_s"]
        assert r["floor_s"] == pytest.approx(r["encode_bytes"] / r["copy_bytes_per_s"], rel=1e-12)
        assert r["fraction_of_floor"] == pytest.approx(r["floor_s"] / r["encode_s"], rel=1e-12)
        assert r["encode_s"] > 0 and r["decode_s"] > 0
        if r["codec"].split(":")[0] in KNOWN:
            assert r["baseline_encode_s"] > 0 and r["baseline_decode_s"] > 0, r
            assert "decode:" in r["baseline"]
        if r["error_feedback"]:  # the decode of a row with error feedback is the row without's
            plain = [p for p in table["rows"] if (p["codec"], p["dtype"], p["numel"], p["error_feedback"]) ==
                     (r["codec"], d, n, False)]
            assert plain[0]["decode_s"] == r["decode_s"]
            assert plain[0]["baseline_decode_s"] == r["baseline_decode_s"]


def test_load_rejects_bad_files(run, tmp_path):
    _, _, table = run
    p = tmp_path / "t.json"

    def write(obj):
        p.write_text(json.dumps(obj) if not isinstance(obj, str) else obj)
        return p

    bad = copy.deepcopy(table)
    del bad["rows"][3]["encode_s"]
    with pytest.raises(ValueError, match=r"rows\[3\]: missing key 'encode_s'"):
        bench.load(write(bad))
    bad = copy.deepcopy(table)
    del bad["copy_bytes_per_s"]
    with pytest.raises(ValueError, match="missing key 'copy_bytes_per_s'"):
        bench.load(write(bad))
    bad = dict(copy.deepcopy(table), format="gradcomp-bench/0")
    with pytest.raises(ValueError, match=r"format 'gradcomp-bench/0'.*gradcomp-bench/1"):
        bench.load(write(bad))
    bad = copy.deepcopy(table)
    del bad["format"]
    with pytest.raises(ValueError, match="missing key 'format'"):
        bench.load(write(bad))
    bad = copy.deepcopy(table)
    bad["rows"][0]["numel"] = "4096"
    with pytest.raises(ValueError, match=r"rows\[0\]: key 'numel'"):
        bench.load(write(bad))
    bad = copy.deepcopy(table)
    bad["rows"][1]["dtype"] = "float64"
    with pytest.raises(ValueError, match=r"rows\[1\]: dtype 'float64'"):
        bench.load(write(bad))
    with pytest.raises(ValueError, match="not a JSON file"):
        bench.load(write("{not json"))
    with pytest.raises(ValueError, match="expected a JSON object"):
        bench.load(write([1, 2]))
    assert bench.load(write(table)) == table


def _row(codec, dtype, numel, ef, enc, dec):
    return {"codec": codec, "dtype": dtype, "numel": numel, "packet_bytes": 48, "error_feedback": ef,
            "encode_s": enc, "decode_s": dec, "encode_bytes": 1, "floor_s": 1.0, "fraction_of_floor": 1.0,
            "baseline": "b", "baseline_encode_s": None, "baseline_decode_s": None}


def test_throughput_picks_the_row():
    rows = [_row("topk:ratio=0.01", "float32", 1 << 12, False, 1e-3, 4e-3),
            _row("topk:ratio=0.01", "float32", 1 << 14, False, 2e-3, 8e-3),
            _row("topk:ratio=0.01", "float32", 1 << 14, True, 5e-3, 8e-3),
            _row("topk:ratio=0.01", "bfloat16", 1 << 14, False, 4e-3, 1e-3),
            _row("fp8", "float32", 1 << 12, True, 1e-3, 2e-3),
            _row("fp8", "float32", 1 << 16, True, 2e-3, 4e-3)]
    table = {"format": "gradcomp-bench/1", "rows": rows}
    assert bench.throughput(table, "topk:ratio=0.01", "float32") == ((1 << 14) / 2e-3, (1 << 14) / 8e-3)
    assert bench.throughput(table, "topk:ratio=0.010", torch.float32) == ((1 << 14) / 2e-3, (1 << 14) / 8e-3)
    assert bench.throughput(table, "topk:ratio=0.01", "bfloat16") == ((1 << 14) / 4e-3, (1 << 14) / 1e-3)
    # only rows with error feedback: the largest of those
    assert bench.throughput(table, "fp8", "float32") == ((1 << 16) / 2e-3, (1 << 16) / 4e-3)
    with pytest.raises(KeyError, match=r"'int8'.*'float32'.*fp8 float32.*topk:ratio=0.01 bfloat16"):
        bench.throughput(table, "int8", "float32")
    with pytest.raises(KeyError, match="'fp8' with dtype 'bfloat16'"):
        bench.throughput(table, "fp8", "bfloat16")


def test_throughput_on_the_run(run):
    _, _, table = run
    for spec in _expected_specs():
        for d in DTYPES:
            r = [r for r in table["rows"] if r["codec"] == spec and r["dtype"] == d and r["numel"] == 1 << 14
                 and not r["error_feedback"]][0]
            assert bench.throughput(table, spec, d) == ((1 << 14) / r["encode_s"], (1 << 14) / r["decode_s"])


def test_cuda_error_without_cuda(capsys, tmp_path):
    if torch.cuda.is_available() and gradcomp.build_info()["cuda"]:
        pytest.skip("CUDA is available here")
    with pytest.raises(SystemExit) as e:
        main(["--device", "cuda", "--sizes", "12", "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--device cuda" in err
    assert ("torch.cuda.is_available() is False" in err) or ("no CUDA backend" in err)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv, msg", [
    (["--dtypes", "float64"], "--dtypes 'float64'; accepted: float32, bfloat16, float16"),
    (["--codecs", "nosuch"], "--codecs 'nosuch'"),
    (["--device", "tpu"], "--device 'tpu'; accepted: cpu, cuda"),
    (["--reps", "0"], "--reps 0"),
    (["--sizes", "41"], "--sizes 41"),
])
def test_bad_arguments(argv, msg, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(argv + ["--out", str(tmp_path)])
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def _codec_decode(c, x):
    pk = c.encode(x)
    return c.decode(pk, out=torch.empty_like(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", EXACT)
def test_baseline_reproduces_the_packet(spec, dtype):
    """The torch sequence decodes to what the codec decodes to; with a residual, leaves the same
    residual (tolerances in the module docstring)."""
    g = torch.Generator().manual_seed(7)
    n = 1 << 12
    x = torch.randn(n, generator=g).to(getattr(torch, dtype))
    c = gradcomp.Codec(spec)
    want = _codec_decode(c, x)
    b = baselines.make(c, x)
    assert b is not None
    b.encode()
    b.decode()
    name = spec.split(":")[0]
    if name == "onebit":
        torch.testing.assert_close(b.out.float(), want.float(), rtol=4e-6 if dtype == "float32" else 8e-3, atol=0)
        assert torch.equal(b.out > 0, want > 0)
    elif name == "topk" and dtype == "bfloat16":  # ties at the threshold may pick other indices
        assert torch.equal(torch.sort(b.out.float().abs())[0], torch.sort(want.float().abs())[0])
    else:
        assert torch.equal(b.out.view(torch.int16 if dtype == "bfloat16" else torch.int32),
                           want.view(torch.int16 if dtype == "bfloat16" else torch.int32)), spec
    if name not in EF_NAMES or (name == "topk" and dtype == "bfloat16"):
        return
    r0 = torch.randn(n, generator=g) * 0.01
    r_c, r_b = r0.clone(), r0.clone()
    pk = c.encode(x, residual=r_c)
    want = c.decode(pk, out=torch.empty_like(x))
    b = baselines.make(c, x, r_b)
    b.encode()
    b.decode()  # onebit: the torch bit-mask decode (the CUDA path), not numpy's
    if name == "onebit":
        torch.testing.assert_close(r_b, r_c, rtol=0, atol=1e-5)  # |s| < 1: a few float32 ulps of s
        torch.testing.assert_close(b.out.float(), want.float(), rtol=4e-6 if dtype == "float32" else 8e-3, atol=0)
        assert torch.equal(b.out > 0, want > 0)
    else:
        assert torch.equal(r_b.view(torch.int32), r_c.view(torch.int32)), spec
        assert torch.equal(b.out.float(), want.float()), spec


def test_default_specs_and_no_baseline():
    assert set(bench.default_specs()) == _expected_specs()
    assert "topk:ratio=0.01" in bench.default_specs()
    x = torch.zeros(1000)  # 1000 is not a multiple of fp8's block of 128
    assert baselines.make(gradcomp.Codec("fp8"), x) is None
    assert baselines.make(gradcomp.Codec("fp16"), x, torch.zeros(1000)) is None  # no error-feedback form
    assert baselines.spec_keys("fp8:format=e5m2,block=17") == {"format": "e5m2", "block": "17"}


def test_encode_bytes_formula():
    assert bench.encode_bytes(1000, "float32", 4048, False) == 8048
    assert bench.encode_bytes(1000, "bfloat16", 2032, True) == 2000 + 2032 + 8000
    assert bench.decode_bytes(1000, "bfloat16", 2032) == 4032


# -- issue 19 (4): interleaved rounds, spreads, and figures that cannot be results are flagged ----
def test_rounds_interleave_every_measurement():
    from gradcomp.bench import runner

    calls = []
    items = {k: (lambda k=k: calls.append(k)) for k in ("copy", "encode", "decode")}
    ts = runner._rounds("cpu", items, 3)
    assert calls[:3] == ["copy", "encode", "decode"]  # the warm-up
    assert calls[3:] == ["copy", "encode", "decode", "encode", "decode", "copy", "decode", "copy", "encode"]
    assert {k: len(v) for k, v in ts.items()} == {"copy": 3, "encode": 3, "decode": 3}
    assert runner._spread([3.0, 1.0, 2.0]) == [1.0, 2.0, 3.0] and runner._spread(None) is None


def test_flags():
    from gradcomp.bench import runner

    ok = {"encode_spread_s": [1.0, 1.1, 1.5], "encode_bytes": 100, "encode_s": 1.0}
    assert runner._flags(ok, copy_bps=100.0) == []
    noisy = dict(ok, encode_spread_s=[1.0, 1.2, 2.5])
    assert runner._flags(noisy, 100.0) == ["noisy encode: slowest round 2.5x the fastest"]
    fast = dict(ok, encode_bytes=120)  # 120 B/s against a 100 B/s copy
    assert runner._flags(fast, 100.0) == ["encode beats the copy floor: 1.20 of copy"]
    assert runner._flags(dict(ok, baseline_encode_spread_s=[1e-3, 1e-3, 9e-3]), 100.0)[0].startswith(
        "noisy baseline encode: slowest round 9.0x")


def test_impossible_figures_are_flagged_not_reported(monkeypatch, tmp_path, capsys):
    """A busy machine: the copy took 1 s in every round while the kernels took microseconds, and
    one kernel's rounds spread 5x. Every such line is marked and named, and the run says so."""
    from gradcomp.bench import runner

    def fake_rounds(device, items, reps):
        out = {}
        for k in items:
            items[k]()
            out[k] = [1.0] * reps if k == "copy" else [1e-6, 5e-6, 1e-6][:reps] if k == "encode" else [1e-6] * reps
        return out

    monkeypatch.setattr(runner, "_rounds", fake_rounds)
    assert main(["--sizes", "12", "--dtypes", "float32", "--codecs", "int8", "--reps", "3", "--threads", "1",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    table = bench.load(tmp_path / "bench_cpu.json")
    row = next(r for r in table["rows"] if not r["error_feedback"])
    assert row["encode_spread_s"] == [1e-6, 1e-6, 5e-6]
    assert any(f.startswith("noisy encode") for f in row["flags"]) and any("beats the copy floor" in f
                                                                          for f in row["flags"])
    assert table["flagged"] == table["measurements"] > 0
    assert "int8 encode" in out and "  !" in out and "! not a result: int8 encode: noisy encode" in out
    assert f"! {table['flagged']} of {table['measurements']} measurements are flagged" in out


# -- issue 21: the hand-written per-codec lists of gradcomp.bench against the registry -------------
def _registry_names():
    return [c["name"] for c in gradcomp.codecs()]


def test_baselines_cover_the_registry():
    """A torch sequence is written per codec (gradcomp.bench.baselines._BUILDERS): one for every
    registered codec, none for a name the registry does not have."""
    names = _registry_names()
    missing = [n for n in names if n not in baselines.CODECS]
    extra = [n for n in baselines.CODECS if n not in names]
    assert not missing, f"registered codecs without a torch sequence in gradcomp.bench.baselines: {missing}"
    assert not extra, f"gradcomp.bench.baselines writes sequences for codecs the registry does not have: {extra}"
    assert list(baselines.CODECS) == names  # registry order
    for c in gradcomp.codecs():  # every default spec gets a sequence at a size every codec divides
        spec = next(s for s in bench.default_specs() if s.split(":")[0] == c["name"])
        assert baselines.make(gradcomp.Codec(spec), torch.zeros(1 << 12)) is not None, spec


def test_ef_codecs_are_registered_and_lossy():
    names = _registry_names()
    for n in baselines.EF_CODECS:
        assert n in names, f"gradcomp.bench.baselines.EF_CODECS names {n!r}, which the registry does not have"
        props = next(c for c in gradcomp.codecs() if c["name"] == n)["properties"]
        assert not props["linear"], f"{n} is linear: error feedback leaves its residual (almost) zero"


def test_exact_covers_every_deterministic_codec():
    # keyed codecs draw their own random numbers: no torch sequence reproduces their packets
    # (test_randomk_baseline_shape checks random-k's)
    deterministic = {c["name"] for c in gradcomp.codecs()
                     if c["properties"]["deterministic"] and not c["properties"]["keyed"]}
    assert deterministic <= {s.split(":")[0] for s in EXACT}, deterministic - {s.split(":")[0] for s in EXACT}
    for s in EXACT:
        assert gradcomp.Codec(s).properties["deterministic"], s


@pytest.mark.parametrize("spec", ["randomk:ratio=0.01", "randomk:k=3,unbiased=true"])
def test_randomk_baseline_shape(spec):
    """torch.randint picks other indices than the codec's strata: k entries of x (times n / k when
    unbiased), zeros elsewhere, and never the global generator."""
    n = 1 << 12
    x = torch.arange(1, n + 1, dtype=torch.float32)
    c = gradcomp.Codec(spec)
    k = c.layout(n)["main_param"]
    state = torch.random.get_rng_state()
    b = baselines.make(c, x)
    b.encode()
    b.decode()
    assert torch.equal(torch.random.get_rng_state(), state)
    nz = torch.nonzero(b.out).flatten()
    assert 1 <= nz.numel() <= k  # randint may repeat an index
    scale = n / k if "unbiased" in spec else 1.0
    assert torch.equal(b.out[nz], x[nz] * scale)
    assert baselines.make(c, x, torch.zeros(n)) is None


def test_qsgd_baseline_shape():
    """GRACE's sequence: per block of 128 at most s + 1 distinct magnitudes, each a multiple of
    norm / s, signs of x; never the global generator."""
    n, s = 1 << 12, 16
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    c = gradcomp.Codec(f"qsgd:levels={s}")
    state = torch.random.get_rng_state()
    b = baselines.make(c, x)
    b.encode()
    b.decode()
    assert torch.equal(torch.random.get_rng_state(), state)
    norm = torch.linalg.vector_norm(x.view(-1, 128), dim=1, keepdim=True)
    level = (b.out.view(-1, 128) / (norm / s))
    assert torch.allclose(level, level.round(), atol=1e-3) and level.abs().max() <= s + 1e-3
    nz = b.out != 0
    assert torch.equal(torch.sign(b.out[nz]), torch.sign(x[nz]))
    assert baselines.make(c, x[:1000]) is None and baselines.make(c, x, torch.zeros(n)) is None


def test_terngrad_baseline_shape():
    """TernGrad's sequence: values in {-s, 0, s} with x's signs, s = max |clip(x)|; never the
    global generator."""
    n = 1 << 12
    x = torch.randn(n, generator=torch.Generator().manual_seed(4))
    x[9] = 50.0
    c = gradcomp.Codec("terngrad")
    state = torch.random.get_rng_state()
    b = baselines.make(c, x)
    b.encode()
    b.decode()
    assert torch.equal(torch.random.get_rng_state(), state)
    s = float(b.out.abs().max())
    assert abs(s - 2.5 * float(torch.std(x, correction=0))) < 1e-4 * s  # the clipped max
    assert set(torch.unique(b.out.abs()).tolist()) <= {0.0, s}
    nz = b.out != 0
    assert torch.equal(torch.sign(b.out[nz]), torch.sign(x[nz])) and nz.sum() > 0
    assert baselines.make(c, x[:1001]) is None and baselines.make(c, x, torch.zeros(n)) is None


def test_keyed_cast_has_no_sequence():
    for c in gradcomp.codecs():
        for ex in c["examples"]:
            codec = gradcomp.Codec(ex)
            if codec.properties["keyed"] and baselines._BUILDERS[c["name"]] is baselines._cast:
                assert baselines.make(codec, torch.zeros(1 << 12)) is None, ex
