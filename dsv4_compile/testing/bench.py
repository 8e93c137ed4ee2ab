"""What the benchmarks share: the case type, CUDA-graph timing, the flop / byte counts their
throughput figures use, and what a results file starts with (:func:`header`) and the
compiled-vs-other ratios of its tables (:func:`compiled_ratios`).

Timing (:func:`graph_us`): ``fn`` runs twice off the capture stream (compile / warm up), then
``inner`` calls are captured in one ``torch.cuda.CUDAGraph``; the graph is replayed ``iters``
times, each replay timed with CUDA events, and the median replay time divided by ``inner`` is
reported, so graph-launch overhead is amortised as inside a full-step graph.

Profiling (:func:`profile_steps`): where a step's time goes — wall time, GPU busy time and kernel
launches per step, and the kernels that take most of it.

Weight floors (:func:`peak_hbm_tbps`): the HBM bandwidth a step's weight bytes are divided by, the
benchmarking GPU's own.

Wall time (:func:`wall_call`): a call's wall seconds with the device work it queued.

Host time (:func:`host_us_per_call`): the host's own time per call of a step, with the GPU kept
busy so that no call waits for it.

Kernel choices (:func:`posted_max_tokens`, :func:`weight_prefetch`, :func:`expert_weight_prefetch`,
:func:`linears_split_k`, :func:`moe_in_op`, :func:`hash_router_in_op`, :func:`normalise_after_sum`,
:func:`learned_router_op`, :func:`norm_in_hc_op`): two ways of a kernel or op, side by side.
Pass lists (:func:`passes_without`, :func:`passes_configured`): the default passes less one, or
with one set otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from .. import layout
from ..config import HEAD_DIM
from ..reference.compressor import window_slots
from .attn_inputs import AttnInputs


@dataclass
class Case:
    """One benchmark row. ``kernel`` / ``reference`` take no arguments (inputs are closed over)
    and must be CUDA-graph capturable; ``bytes`` is the HBM traffic the GB/s figure uses."""

    name: str
    params: dict
    kernel: Callable[[], object]
    reference: Callable[[], object] | None
    bytes: int
    family: str = ""
    notes: str = ""
    extra: dict = field(default_factory=dict)


def wall_call(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """``(fn(), wall seconds)``: on CUDA the device is synchronised before the clock starts and
    before it stops, so the seconds include the work ``fn`` queued."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return result, time.perf_counter() - start


def graph_us(fn: Callable[[], object], iters: int, inner: int, before: Callable[[], object] | None = None
             ) -> float:
    """Median µs per call of ``fn`` (preceded by ``before`` if given) over CUDA-graph replays."""
    def calls():
        if before is not None:
            before()
        fn()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph expects
        for _ in range(2):
            calls()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            calls()
    graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
    del graph
    return 1e3 * ms / inner


def host_us_per_call(call: Callable[[], object], calls: int, sleep_s: float = 1.0) -> float:
    """Median host µs of ``calls`` calls of ``call`` (already warmed up), queued behind a
    ``torch.cuda._sleep`` of at least ``sleep_s`` seconds: while the GPU sleeps no call can wait
    for it, so the figure is the host's work alone (Python, guards, launches). Keep a call's
    launches few (CUDA-graph replays): a full launch queue would block the host too."""
    times = []
    torch.cuda.synchronize()
    torch.cuda._sleep(int(sleep_s * 2e9))  # cycles: >= sleep_s up to the H200's 1.98 GHz boost clock
    first = time.perf_counter()
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    if time.perf_counter() - first > sleep_s:
        raise RuntimeError(f"{calls} calls took more host time than the {sleep_s} s sleep: raise sleep_s")
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def profile_steps(run_steps: Callable[[int], object], steps: int, top: int | None = 25) -> dict[str, Any]:
    """Profile ``run_steps(steps)`` (``steps`` consecutive steps, already warmed up) on CUDA.

    Returns per step: ``wall_us`` (host wall time, device work included), ``gpu_busy_us`` (summed
    kernel durations), ``gpu_active_us`` (the time at least one kernel runs: a kernel launched with
    programmatic dependent launch starts while its predecessor still runs and waits inside, so the
    durations overlap and their sum counts that wait twice), ``gpu_idle_us`` (the gaps between
    kernels within the profiled span), ``host_overhead_us`` (wall minus active: the time the GPU
    waits for the host), ``kernels`` (launches), ``memcpy_us`` (copies and memsets, the device's
    copy work), ``copies`` (that work by kind: ``{"name", "us_per_step", "calls_per_step"}``); and
    ``top``: the ``top`` kernels by
    time (``None``: all), each ``{"name", "us_per_step", "critical_us_per_step", "calls_per_step"}``,
    where ``critical`` is the time from the end of whatever ran before the kernel to its own end,
    the part of the step's active time the kernel adds (a PDL wait is not in it); ``timeline``: the
    last step's kernels, copies and memsets in launch order, each ``{"name", "grid", "start_us",
    "us", "critical_us"}`` (start from the step's first kernel; grid as the profiler's trace records
    it, None for a copy), which tells apart the launches of one kernel (a projection's weight by its
    grid) and places each copy between the kernels around it.
    """
    from torch.profiler import ProfilerActivity, profile

    # detach CUPTI when the profile ends: left attached (the profiler's default) it slows every
    # later launch in the process and widens the gaps between a graph's kernels
    os.environ.setdefault("TEARDOWN_CUPTI", "1")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run_steps(steps)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    timeline = _last_step_timeline(prof, steps)
    kernels: dict[str, list[float]] = {}
    critical: dict[str, float] = {}
    spans: list[tuple[float, float, str]] = []
    copies: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if ev.name.startswith("Memcpy") or ev.name.startswith("Memset"):
            copies.setdefault(ev.name, []).append(ev.device_time_total)
        else:
            kernels.setdefault(ev.name, []).append(ev.device_time_total)
            spans.append((ev.time_range.start, ev.time_range.end, ev.name))
    reached = idle = active = 0.0
    for begin, end, name in sorted(spans):
        if reached and begin > reached:
            idle += begin - reached
        added = max(0.0, end - max(begin, reached))
        critical[name] = critical.get(name, 0.0) + added
        active += added
        reached = max(reached, end)
    busy = sum(sum(t) for t in kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: -critical[kv[0]])[:top]
    return {"wall_us": 1e6 * wall / steps, "gpu_busy_us": busy / steps, "gpu_active_us": active / steps,
            "gpu_idle_us": idle / steps, "host_overhead_us": 1e6 * wall / steps - active / steps,
            "kernels": sum(len(t) for t in kernels.values()) / steps,
            "memcpy_us": sum(sum(t) for t in copies.values()) / steps,
            "copies": [{"name": name, "us_per_step": sum(t) / steps, "calls_per_step": len(t) / steps}
                       for name, t in sorted(copies.items())],
            "top": [{"name": name[:120], "us_per_step": sum(t) / steps, "critical_us_per_step": critical[name] / steps,
                     "calls_per_step": len(t) / steps}
                    for name, t in ranked],
            "timeline": timeline}


_DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # the Chrome trace's categories of device work


def _last_step_timeline(prof, steps: int) -> list[dict[str, Any]]:
    """The kernels, copies and memsets of the last of ``steps`` profiled steps (every step
    launches the same number), in order, from the profiler's Chrome trace: the only export that
    keeps each launch's grid."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    launches = sorted((e for e in events if e.get("cat") in _DEVICE_WORK and "dur" in e), key=lambda e: e["ts"])
    last = launches[len(launches) - len(launches) // steps:] if steps else []
    out, reached = [], last[0]["ts"] if last else 0.0
    for e in last:
        end = e["ts"] + e["dur"]
        out.append({"name": e["name"][:120], "grid": e.get("args", {}).get("grid"), "start_us": e["ts"] - last[0]["ts"],
                    "us": e["dur"], "critical_us": max(0.0, end - max(e["ts"], reached))})
        reached = max(reached, end)
    return out


def sparse_attn_flops(inp: AttnInputs) -> float:
    """QK and PV of ``dsv4::sparse_attn``, both over the full 512 dims: ``2 * 2 * H * 512`` per
    (row, entry); every row assumed full length."""
    rows, heads, _ = inp.q.shape
    return 4.0 * heads * HEAD_DIM * inp.entries_per_row() * rows


def sparse_attn_bytes(inp: AttnInputs) -> float:
    """HBM traffic of ``dsv4::sparse_attn``: gathered cache entries (584 B each, counted once per
    row even when rows share entries) plus q read and out written (bf16)."""
    rows, heads, _ = inp.q.shape
    return rows * (layout.TOKEN_BYTES * inp.entries_per_row() + 2 * 2 * heads * HEAD_DIM)


def compress_kv_bytes(args: dict[str, Any]) -> int:
    """HBM traffic of ``dsv4::compress_kv(**args)``: per row, kv + score read (2 x Wc elements of
    their dtype), the ring written (8 Wc B) and the entry (2 d B); each window-completing row also
    reads its ring slots (S x 2 x 4 d B at most)."""
    ratio, d = args["ratio"], args["norm_weight"].shape[0]
    rows, wc = args["kv"].shape
    windows = int((args["seq_lens_causal"] % ratio == 0).sum())
    read = 2 * args["kv"].element_size() * wc
    return rows * (read + 8 * wc + 2 * d + 16) + windows * window_slots(ratio) * 8 * d


# Peak HBM bandwidth in TB/s by a substring of ``torch.cuda.get_device_name``, most specific first
# (an H100 SXM and an H100 NVL both have HBM3, at different clocks and widths).
PEAK_HBM_TBPS = {"H200": 4.8, "H100 NVL": 3.9, "H100 PCIe": 2.0, "H100": 3.35}
DEFAULT_HBM_TBPS = PEAK_HBM_TBPS["H200"]


def peak_hbm_tbps(device_name: str | None) -> float:
    """The peak HBM bandwidth (TB/s) of the GPU named ``device_name``; the H200's for no GPU or one
    not in :data:`PEAK_HBM_TBPS` (pass the figure explicitly for those)."""
    for key, tbps in PEAK_HBM_TBPS.items():
        if device_name and key in device_name:
            return tbps
    return DEFAULT_HBM_TBPS


def hbm_tbps_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--hbm-tbps``, the bandwidth a weight floor divides by: the benchmarking GPU's peak unless
    given (:func:`peak_hbm_tbps`)."""
    peak = peak_hbm_tbps(torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    parser.add_argument("--hbm-tbps", type=float, default=peak,
                        help=f"HBM bandwidth of the weight floor in TB/s (default: this GPU's peak, {peak}; "
                             f"known: {PEAK_HBM_TBPS})")


def header(device: str, args: argparse.Namespace) -> dict[str, Any]:
    """What every results file starts with: date, commit, device, versions, arguments."""
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu"
    return {"date": datetime.date.today().isoformat(), "commit": _commit(), "device": name,
            "torch": torch.__version__, "transformers": transformers.__version__, "args": vars(args)}


def _commit() -> str | None:
    """The checkout's short HEAD, ``-dirty`` when tracked files differ from it; None outside git."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", "-C", str(Path(__file__).parent), *argv], capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        return git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "-uno") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def compiled_ratios(times: dict[str, float | None]) -> dict[str, float]:
    """``compiled_vs_<way>``: each other way's time over the ``compiled`` time (> 1: compiled is
    faster); ways without a time are left out."""
    if not times.get("compiled"):
        return {}
    return {f"compiled_vs_{way}": t / times["compiled"] for way, t in times.items() if way != "compiled" and t}


@contextlib.contextmanager
def _kernel_setting(module, name: str, value):
    """``module.name = value`` while entered (a launcher reads it at each launch, so a CUDA graph
    keeps the way it captured)."""
    own = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, own)


def posted_max_tokens(limit: int):
    """While entered, ``dsv4::hc_post_pre`` makes the new streams inside the projection up to
    ``limit`` tokens (``ops.kernels.hyper_connection.POSTED_MAX_TOKENS``; 0: ``hc_post`` then
    ``hc_pre`` always)."""
    from ..ops.kernels import hyper_connection

    return _kernel_setting(hyper_connection, "POSTED_MAX_TOKENS", limit)


def weight_prefetch(enabled: bool):
    """While entered, ``dsv4::linears`` / ``dsv4::grouped_linear`` launch with PDL and their weight
    prefetch (``ops.kernels.linear.WEIGHT_PREFETCH``) or without."""
    from ..ops.kernels import linear

    return _kernel_setting(linear, "WEIGHT_PREFETCH", enabled)


def expert_weight_prefetch(enabled: bool):
    """While entered, the routed experts' and the learned router's launches use PDL and their
    weight prefetch (``ops.kernels.experts.WEIGHT_PREFETCH``) or not."""
    from ..ops.kernels import experts

    return _kernel_setting(experts, "WEIGHT_PREFETCH", enabled)


def linears_max_rows(rows: int):
    """While entered, ``dsv4::linears`` runs its kernel up to ``rows`` rows of x and ``torch.mm``
    above (``ops.kernels.linear.MAX_ROWS``)."""
    from ..ops.kernels import linear

    return _kernel_setting(linear, "MAX_ROWS", rows)


def linears_split_k(rows: int):
    """While entered, ``dsv4::linears`` splits K for groups of up to ``rows`` weight rows
    (``ops.kernels.linear.SPLIT_K_ROWS``; 0: never)."""
    from ..ops.kernels import linear

    return _kernel_setting(linear, "SPLIT_K_ROWS", rows)


def norm_in_hc_op(enabled: bool):
    """While entered, the model step applies each block's input norm (and the final norm) inside the
    mHC op of its collapse (``hf_hyper_connection.NORM_IN_OP``) or as the norm module on its output."""
    from .. import hf_hyper_connection

    return _kernel_setting(hf_hyper_connection, "NORM_IN_OP", enabled)


def moe_in_op(enabled: bool):
    """While entered, the model step runs each MoE layer around ``dsv4::moe_experts``
    (``hf_experts.MOE_IN_OP``) or as the block's own forward (its router's product, the routed
    experts' launches, the shared expert's three products)."""
    from .. import hf_experts

    return _kernel_setting(hf_experts, "MOE_IN_OP", enabled)


def hash_router_in_op(enabled: bool):
    """While entered, the model step computes each hash-routed MoE layer's router logits inside
    ``dsv4::moe_experts`` (``hf_experts.HASH_ROUTER_IN_OP``) or through the layer's gate, a product
    launched on its own."""
    from .. import hf_experts

    return _kernel_setting(hf_experts, "HASH_ROUTER_IN_OP", enabled)


def normalise_after_sum(enabled: bool):
    """While entered, each MoE layer of the model step divides its weighted sum by the sum of the
    routing scores (``hf_experts.NORMALISE_AFTER_SUM``) or each weight, as transformers does."""
    from .. import hf_experts

    return _kernel_setting(hf_experts, "NORMALISE_AFTER_SUM", enabled)


def learned_router_op(enabled: bool):
    """While entered, each learned router of the model step runs as ``dsv4::router_topk``
    (``hf_experts.LEARNED_ROUTER_OP``) or as transformers' gate."""
    from .. import hf_experts

    return _kernel_setting(hf_experts, "LEARNED_ROUTER_OP", enabled)


def passes_without(kind: type) -> list:
    """The default passes less the one of type ``kind``."""
    from ..fx_passes.pass_manager import default_passes
    return [p for p in default_passes() if not isinstance(p, kind)]


def passes_configured(kind: type, **settings) -> list:
    """The default passes with the one of type ``kind`` made as ``kind(**settings)`` (its other
    settings, devices included, at their defaults)."""
    from ..fx_passes.pass_manager import default_passes
    return [kind(**settings) if isinstance(p, kind) else p for p in default_passes()]
