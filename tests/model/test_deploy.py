"""AOT deployment on the CPU: a package of a checkpoint's steps (``python -m dsv4_compile.package_cli``,
built once) run in fresh processes, from Python and from the C++ runner, against the eager backend.

The package is built with every op inlined (libtorch alone runs it) and Inductor rounding to bf16
where eager does (``export.EXACT_NUMERICS``). What remains between the package and the eager
backend is the order of Inductor's fused reductions: on this model, fed the same tokens, every
step's logits agree within one bf16 rounding step at their scale (largest relative error 0.029
measured on these prompts; up to 0.082 on others, docs/deploy.md "Numerics") and the FP8 pools
differ in under 0.5 % of their bytes. Its cache is larger than its
weights: a package holding the cache could not stay under the size asserted below.
"""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from torch._inductor.package import load_package

from dsv4_compile import deploy, export, hf_experts
from dsv4_compile.export import METADATA_KEY, PROGRAMS
from dsv4_compile.model import enable
from dsv4_compile.step import ForwardMode, StepInputs
from tests.model.conftest import load_tiny_hf
from tests.support.hf_model import tiny_hf_config, tiny_hf_model

ROOT = Path(__file__).resolve().parents[2]
MAX_REQUESTS, MAX_SEQ_LEN = 4, 4096  # cache of 4 x 4096 positions: ~62 MiB, more than the weights
PROMPT_LENGTHS, NEW_TOKENS = (300, 37, 5), 17  # the first prompt prefills in two chunks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A 3-layer tiny checkpoint: sliding, CSA and HCA attention, hash and learned MoE."""
    path = tmp_path_factory.mktemp("deploy_ckpt")
    tiny_hf_model(seed=0, path=path, config=tiny_hf_config(num_hidden_layers=3))
    return path


@pytest.fixture(scope="module")
def package_path(checkpoint, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("deploy_pkg") / "model.pt2"
    done = _python("-m", "dsv4_compile.package_cli", "--model", str(checkpoint), "--out", str(path),
                   "--max-requests", str(MAX_REQUESTS), "--max-seq-len", str(MAX_SEQ_LEN))
    assert done.returncode == 0, done.stderr[-3000:]
    assert path.is_file() and "wrote" in done.stdout
    return path


@pytest.fixture
def backend(checkpoint):
    """The eager backend on the same checkpoint, with the package's capacity."""
    return enable(load_tiny_hf(checkpoint), max_requests=MAX_REQUESTS, max_seq_len=MAX_SEQ_LEN)


def _python(*args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=timeout)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


# package vs eager, fed the same tokens: largest |Δ logit| of a step over its largest |logit|, the
# share of the steps' greedy tokens that agree, the share of FP8 pool bytes that differ
LOGIT_RTOL, GREEDY_AGREE, POOL_BYTES_DIFFER = 0.06, 0.95, 0.01


class _Recorder:
    """A step that keeps a copy of the logits of every step it runs; with ``replay`` (the logits
    of another run, step by step) it returns those instead, so that both runs decode the same
    tokens."""

    def __init__(self, model, replay: list[torch.Tensor] | None = None):
        self.model, self.allocator, self.cache, self.logits = model, model.allocator, model.cache, []
        self.replay = replay

    def __call__(self, *args):
        out = self.model(*args)
        self.logits.append(out.clone())
        return out if self.replay is None else self.replay[len(self.logits) - 1]


_FRESH_PROCESS = """
import sys, torch
from torch._dynamo.utils import counters
from dsv4_compile import deploy
from tests.model.test_deploy import _Recorder, _prompts
model = deploy.load(sys.argv[1])
rec = _Recorder(model, replay=torch.load(sys.argv[2]))
deploy.greedy_generate(rec, _prompts(), {new}, chunk=model.info.limits.max_tokens)
compiled = sum(counters["stats"].values()) + sum(counters["inductor"].values())
torch.save({{"logits": rec.logits, "compiled": compiled,
            "cache": {{n: t.clone() for n, t in model.cache.named_buffers()}}}}, sys.argv[3])
"""


def test_package_in_a_fresh_process_matches_the_eager_backend(package_path, backend, tmp_path):
    """Prefill (a chunked one among them) and 16 decode steps of three requests, the package fed
    the eager backend's greedy tokens: each step's logits and the cache at the end agree with the
    eager backend's within Inductor's reduction-order rounding; the index maps are equal; nothing
    compiles in the package's process."""
    eager = _Recorder(backend)
    deploy.greedy_generate(eager, _prompts(), NEW_TOKENS, chunk=_max_tokens(package_path))
    replay, out = tmp_path / "eager_logits.pt", tmp_path / "run.pt"
    torch.save(eager.logits, replay)
    done = _python("-c", _FRESH_PROCESS.format(new=NEW_TOKENS), str(package_path), str(replay), str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(out)
    assert got["compiled"] == 0 and len(got["logits"]) == len(eager.logits) == len(PROMPT_LENGTHS) + 1 + NEW_TOKENS - 1
    agree = []
    for step, (want, have) in enumerate(zip(eager.logits, got["logits"])):
        want, have = want.float(), have.float()
        assert (want - have).abs().max() <= LOGIT_RTOL * want.abs().max(), f"step {step}"
        agree += (want.argmax(-1) == have.argmax(-1)).tolist()
    assert sum(agree) >= GREEDY_AGREE * len(agree)
    for name, want in backend.cache.named_buffers():
        have = got["cache"][name]
        if want.dtype == torch.uint8:  # FP8 pools: a rounding flip changes an entry's bytes
            assert (have != want).float().mean() <= POOL_BYTES_DIFFER, name
        elif want.dtype == torch.int32:  # the index maps, written by the allocator alone
            assert torch.equal(have, want), name
        else:  # compressor rings, fp32: a rounding flip upstream moves single projections further
            diff, scale = (have - want).abs(), want.abs().max()
            assert diff.mean() <= 1e-3 * scale and (diff > LOGIT_RTOL * scale).float().mean() <= 1e-3, name


def _max_tokens(package_path) -> int:
    return deploy.load(package_path).info.limits.max_tokens


def test_runner_on_the_package_matches_the_runner_on_the_backend(package_path, backend):
    """The ModelRunner serves a package as it serves the backend (continuous batching, chunked
    prefill): the same teacher-forced log-probs within rounding."""
    model = deploy.load(package_path, max_requests=MAX_REQUESTS, max_seq_len=MAX_SEQ_LEN)
    want, got = torch.cat(backend.runner.score(_prompts())), torch.cat(model.runner.score(_prompts()))
    assert want.shape == got.shape == (sum(PROMPT_LENGTHS) - len(PROMPT_LENGTHS),)
    assert (want - got).abs().mean() < 0.01 and (want - got).abs().max() < 0.1
    assert len(model.runner.generate(_prompts(), 4)[0]) == 4


@pytest.mark.parametrize("max_tokens", [100, 1])
def test_runner_on_limits_that_are_not_bucket_sizes(package_path, backend, max_tokens):
    """A package whose token limit is not a bucket size (100), or is 1: its runner's steps stay
    within the limits (no bucket padding past them; 2 logit rows, which every program takes), and
    score as the backend's runner does."""
    loaded = deploy.load(package_path)
    info = dataclasses.replace(loaded.info, limits=export.ExportLimits(max_tokens, loaded.info.limits.max_batch))
    model = deploy.DeployedModel(str(package_path), loaded.programs, info, loaded.cache.device)
    prompts = _prompts()[1:] if max_tokens > 1 else [p[:3] for p in _prompts()]
    want, got = torch.cat(backend.runner.score(prompts)), torch.cat(model.runner.score(prompts))
    assert (want - got).abs().mean() < 0.01 and (want - got).abs().max() < 0.1
    assert not model.allocator.active_rows


def test_steps_of_other_index_dtypes_strides_and_no_request_run_as_exported(package_path, backend):
    """The programs take their inputs unchecked, so the package converts what validation accepts:
    per-request vectors in int64, slots in int32 and strided token ids give the logits of the
    step in the exported dtypes; a step of padding rows and no request (which the programs were
    not exported for) runs as one with the step builder's padding request, writing no index map."""
    model = deploy.load(package_path)
    ids = torch.tensor(_prompts()[1][:20])
    for target in (backend, model):
        row = target.allocator.admit()
        loc = target.allocator.extend(row, 20)
    want = backend(ids, StepInputs.make(ForwardMode.EXTEND, [row], [20], [20], loc), torch.tensor([0, 19])).float()
    wide = torch.tensor([row, 20, 20], dtype=torch.int64)
    step = StepInputs(ForwardMode.EXTEND, wide[:1], wide[1:2], wide[2:], loc.to(torch.int32))
    strided_ids = torch.stack([ids, torch.zeros_like(ids)], 1)[:, 0]
    got = model(strided_ids, step, torch.tensor([0, 7, 19])[::2]).float()
    assert (want - got).abs().max() <= LOGIT_RTOL * want.abs().max()
    maps = [t.clone() for t in model.cache.buffers() if t.dtype == torch.int32]
    idle = model(torch.zeros(2, dtype=torch.int64), StepInputs.idle(2), torch.tensor([0, 1]))
    assert idle.shape == (2, model.vocab_size) and torch.isfinite(idle.float()).all()
    assert all(torch.equal(a, b) for a, b in zip(maps, (t for t in model.cache.buffers() if t.dtype == torch.int32)))


def test_greedy_generate_refuses_an_empty_prompt_and_releases_its_rows(package_path):
    model = deploy.load(package_path)
    with pytest.raises(ValueError, match="prompts: prompt 1 is empty"):
        deploy.greedy_generate(model, [[1, 2, 3], []], 2, chunk=8)
    with pytest.raises(ValueError, match="step.out_cache_loc has"):
        deploy.greedy_generate(model, [[1, 2, 3], _prompts()[0]], 2, chunk=len(_prompts()[0]))  # past the limit
    assert not model.allocator.active_rows


def test_package_cli_refuses_an_out_path_it_cannot_write(tmp_path, capsys):
    from dsv4_compile import package_cli

    out = tmp_path / "missing" / "model.pt2"
    assert package_cli.main(["--model", str(tmp_path), "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"{package_cli.PROG}: error: --out {out}: no directory {out.parent}\n"


def test_package_runs_with_torch_alone(package_path, tmp_path):
    """Loaded and run by a process that never imports dsv4_compile (no dsv4:: op is registered)."""
    code = textwrap.dedent("""
        import json, sys, torch
        from torch._inductor.package import load_package
        decode = load_package(sys.argv[1], "decode")
        info = json.loads(decode.get_metadata()["dsv4_compile"])
        cache = [torch.zeros(shape, dtype=getattr(torch, dtype)) for _, shape, dtype in info["cache"]]
        i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
        # two padding requests on the dummy row: slot 0, length 0
        logits = decode(torch.tensor([5, 7]), i32(0, 0), i32(0, 0), i32(0, 0), torch.zeros(2, dtype=torch.int64),
                        torch.tensor([0, 1]), *cache)
        assert "dsv4_compile" not in sys.modules
        print(tuple(logits.shape), bool(torch.isfinite(logits).all()))
    """)
    done = _python("-c", code, str(package_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["(2,", "512)", "True"]


def test_package_holds_the_weights_not_the_cache(package_path, backend):
    """Each program's constants are the model's tensors (``model.*``, and the attention layers'
    RoPE tables ``attn_layers.*``), none of the cache's; the package is smaller than the cache."""
    for name in PROGRAMS:
        constants = load_package(str(package_path), name).get_constant_fqns()
        assert constants and all(c.startswith(("model.", "attn_layers.")) for c in constants)
    size = package_path.stat().st_size
    assert size < backend.cache.nbytes()
    param_bytes = sum(p.numel() * p.element_size() for p in backend.model.parameters())
    assert size < len(PROGRAMS) * param_bytes + 16 * 2**20  # weights once per program plus code


def test_cache_writes_happen_in_place(package_path, backend):
    """No program allocates a buffer of a pool's shape or size (a copy to write into and copy back:
    what a mutation Inductor fails to reinplace costs, the whole pool every step); the pools are
    written through their input pointers. Read off the generated C++ the package carries."""
    with zipfile.ZipFile(package_path) as archive:
        wrappers = [archive.read(n).decode() for n in archive.namelist() if n.endswith(".wrapper.cpp")]
    allocated = {shape for code in wrappers for shape in re.findall(r"int_array_\d+\[\] = (\{[^}]*\})", code)}
    assert len(wrappers) == len(PROGRAMS) and allocated  # the pattern reads the sizes
    for name, pool in backend.cache.named_buffers():
        as_2d, as_1d = "{" + ", ".join(f"{d}L" for d in pool.shape) + "}", f"{{{pool.numel()}L, }}"
        assert not {as_2d, as_1d} & allocated, name


def test_metadata_and_capacity_checks(package_path, tmp_path):
    model = deploy.load(package_path)
    info = json.loads(load_package(str(package_path), "extend").get_metadata()[METADATA_KEY])
    assert (info["max_requests"], info["max_seq_len"], tuple(info["programs"])) == (MAX_REQUESTS, MAX_SEQ_LEN, PROGRAMS)
    assert model.config.compress_ratios == (0, 4, 128)
    with pytest.raises(deploy.PackageError, match="max_requests=8: the package .* was built for max_requests=4"):
        deploy.load(package_path, max_requests=8)
    with pytest.raises(deploy.PackageError, match="max_seq_len=512"):
        deploy.load(package_path, max_seq_len=512)
    with pytest.raises(deploy.PackageError, match="config="):
        deploy.load(package_path, config=model.config.with_(index_topk=128))
    assert model.cache.device.type == "cpu"  # the device the package was compiled for
    with pytest.raises(deploy.PackageError, match="device='cuda': the package .* was built for device='cpu'"):
        deploy.load(package_path, device="cuda")
    with pytest.raises(FileNotFoundError, match="path: no package"):
        deploy.load(tmp_path / "missing.pt2")
    not_a_package = tmp_path / "other.pt2"
    with zipfile.ZipFile(not_a_package, "w") as z:
        z.writestr("other/data/readme.txt", "x")
    with pytest.raises(deploy.PackageError, match="not an AOTInductor package"):
        deploy.load(not_a_package)
    not_a_zip = tmp_path / "text.pt2"
    not_a_zip.write_text("not a package")
    with pytest.raises(deploy.PackageError, match="not an AOTInductor package"):
        deploy.load(not_a_zip)


def test_steps_beyond_the_package_limits_are_refused(package_path):
    model = deploy.load(package_path)
    limits = model.info.limits
    row = model.allocator.admit()
    too_many = limits.max_tokens + 1
    loc = model.allocator.extend(row, too_many)
    step = StepInputs.make(ForwardMode.EXTEND, [row], [too_many], [too_many], loc)
    before = [t.clone() for t in model.cache.buffers()]
    with pytest.raises(ValueError, match=rf"step.out_cache_loc has {too_many} rows; the package .* at most {limits.max_tokens}"):
        model(torch.zeros(too_many, dtype=torch.int64), step, torch.tensor([0, 1]))
    assert all(torch.equal(a, b) for a, b in zip(before, model.cache.buffers()))


def test_c_shim_lookup_reads_the_header():
    """``has_c_shim`` answers from the shim header packages compile against: ops every shim has,
    and a name none has."""
    for device in (torch.device("cpu"), torch.device("cuda")):
        assert export.has_c_shim("addmm_out", device)
        assert not export.has_c_shim("no_such_op", device)


def test_export_swaps_the_experts_for_packageable_ones(backend, monkeypatch):
    """A package holds ``grouped_mm`` experts in place of the backend's own (whose CUDA kernels are
    Python launchers), and ``batched_mm`` ones where the CUDA shim has no ``_grouped_mm`` (torch
    2.11): each computes the same MoE (the same logits here, bit for bit on the CPU); the model gets
    its own back afterwards."""
    model, own = backend.model, backend.model.config._experts_implementation
    assert own == hf_experts.IMPLEMENTATION
    row = backend.allocator.admit()
    step = StepInputs.make(ForwardMode.EXTEND, [row], [20], [20], backend.allocator.extend(row, 20))
    ids, rows = torch.arange(20) % backend.vocab_size, torch.tensor([3, 19])

    def logits():  # the same step on a clean copy of the cache each time
        saved = [t.clone() for t in backend.cache.buffers()]
        out = backend(ids, step, rows)
        for t, s in zip(backend.cache.buffers(), saved):
            t.copy_(s)
        return out

    want = logits()
    with export._packageable_experts(model, torch.device("cpu")):
        assert model.config._experts_implementation == "grouped_mm"
        assert torch.equal(logits(), want)
    monkeypatch.setattr(export, "has_c_shim", lambda op, device: op != "_grouped_mm")
    with export._packageable_experts(model, torch.device("cuda")):
        assert model.config._experts_implementation == export.SHIMLESS_EXPERTS_FALLBACK
        assert torch.equal(logits(), want)  # on the CPU the two compute bit for bit the same
    assert model.config._experts_implementation == own
    monkeypatch.setattr(export, "has_c_shim", lambda op, device: True)
    with export._packageable_experts(model, torch.device("cuda")):
        assert model.config._experts_implementation == "grouped_mm"
    assert model.config._experts_implementation == own


@pytest.fixture(scope="module")
def cpp_runner(tmp_path_factory) -> Path:
    if not (shutil.which("cmake") and (shutil.which("c++") or shutil.which("g++"))):
        pytest.skip("needs cmake and a C++ compiler")
    build = tmp_path_factory.mktemp("deploy_cpp")
    prefix = torch.utils.cmake_prefix_path
    for cmd in (["cmake", "-S", str(ROOT / "deploy" / "cpp"), "-B", str(build), f"-DCMAKE_PREFIX_PATH={prefix}",
                 "-DCMAKE_BUILD_TYPE=Release"], ["cmake", "--build", str(build)]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return build / "dsv4_generate"


def test_cpp_runner_tokens_equal_the_python_runner(cpp_runner, package_path):
    """The same steps on the same package from C++ and from Python: the same greedy tokens."""
    prompts = _prompts()
    done = subprocess.run([str(cpp_runner), str(package_path), str(NEW_TOKENS), *(",".join(map(str, p)) for p in prompts)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    cpp = [[int(t) for t in line.split(",")] for line in done.stdout.split()]
    model = deploy.load(package_path)
    assert cpp == deploy.greedy_generate(model, prompts, NEW_TOKENS, chunk=model.info.limits.max_tokens)


def test_cpp_runner_refuses_what_is_not_a_package(cpp_runner, tmp_path):
    done = subprocess.run([str(cpp_runner), str(tmp_path / "missing.pt2"), "4", "1,2,3"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.startswith("dsv4_generate: ")
    done = subprocess.run([str(cpp_runner)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "usage" in done.stderr


def test_export_limits_of_one_request_and_one_token(checkpoint):
    """Limits of 1 (a cache of one request row, ``--max-requests 1``) export: the symbolic sizes
    reach the tracing examples' 2 (``deploy`` enforces the limits), and the decode program runs a
    one-request step; limits below 1 are refused by name."""
    backend = enable(load_tiny_hf(checkpoint), max_requests=1, max_seq_len=256)
    program = export.export_steps(backend, ("decode",), limits=export.ExportLimits(1, 1))["decode"]
    assert {(r.lower, r.upper) for r in program.range_constraints.values()} == {(1, 2)}
    step = [t[:1] for t in export.example_inputs(backend, "decode")[:len(export.STEP_INPUTS)]]
    logits = program.module()(*step, *backend.cache.buffers())
    assert logits.shape == (1, backend.vocab_size) and torch.isfinite(logits.float()).all()
    with pytest.raises(ValueError, match="ExportLimits.max_tokens=0 must be an int >= 1"):
        export.ExportLimits(0, 1)
