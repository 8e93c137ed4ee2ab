"""The ranks' side of ``tests/model/test_tensor_parallel.py``: ``torch.multiprocessing.spawn`` runs
:func:`run_rank` in 2 processes, over gloo on the CPU or NCCL on 2 GPUs; each saves what it
measured to ``rank{r}.pt`` for the test process to compare.

Every rank runs the same steps on the tiny checkpoint: first the model on one device (the
reference, computed on each rank alike), then the model sharded by ``enable(device_mesh=...)``,
eager and compiled, then the checkpoint loaded sharded by ``transformers`` with expert parallelism.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import DeepseekV4ForCausalLM

from dsv4_compile.compile import compile_step
from dsv4_compile.model import enable
from dsv4_compile.parallel import ATTENTION_TP_PLAN
from dsv4_compile.runner import ModelRunner
from dsv4_compile.step import ForwardMode
from tests.support.compile_checks import GraphCapture, fresh_compile_state, graph_breaks
from tests.support.hf_model import tiny_hf_config, tiny_hf_model

WORLD = 2
VOCAB = 512
CACHE = dict(max_requests=2, max_seq_len=256)


def run_rank(rank: int, checkpoint: str, out_dir: str, device_type: str = "cpu") -> None:
    """One rank on the CPU (gloo) or on ``cuda:rank`` (NCCL): join the group (a file store in
    ``out_dir``), measure, save ``rank{rank}.pt`` (on the CPU)."""
    os.environ.update(HF_HUB_OFFLINE="1", LOCAL_RANK=str(rank))  # transformers' loader binds cuda:LOCAL_RANK
    torch.set_num_threads(1)  # two ranks on two cores
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{out_dir}/store", rank=rank, world_size=WORLD)
    try:
        with torch.no_grad():
            results = measure(checkpoint, init_device_mesh(device_type, (WORLD,)))
        torch.save(_to_cpu(results), f"{out_dir}/rank{rank}.pt")
        dist.barrier()  # as the CLI: no rank closes its connections while a peer may still be reading
    finally:
        dist.destroy_process_group()


def _to_cpu(results):
    """``results`` with every tensor on the CPU."""
    return torch.utils._pytree.tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, results)


def measure(checkpoint: str, mesh) -> dict:
    """Logits of :func:`scenario` on one device and on the mesh (sharded by ``enable`` and loaded
    sharded, eager and compiled: the graph breaks, frames and all-reduces), the cache and allocator
    afterwards, and the model's own forward and the runner's sampling on the mesh."""
    model = load(checkpoint).to(mesh.device_type)  # cuda: the rank's device
    backend = enable(model, **CACHE)
    results = {"reference": scenario(backend.runner), "reference_forward": forward(model)}
    backend.close()
    backend = enable(model, **CACHE, device_mesh=mesh)
    results["eager"], results["cache"], results["allocator"] = scenario(backend.runner, keep=True)
    results["local_heads"] = (backend.config.num_heads, backend.config.o_groups)
    results["shards_own_their_storage"] = all(  # no rank keeps a whole weight behind its slice
        p.to_local().untyped_storage().nbytes() == p.to_local().nbytes for p in model.parameters()
        if isinstance(p, DTensor))
    results.update(compiled=compiled(backend), forward=forward(model))
    results["forward_error"] = transformers_forward_error(model)
    results["sampled"] = backend.runner.generate([ids(5, seed=3)], 4, temperature=1.0)  # seed=None
    prompt = torch.tensor([ids(5, seed=3)], device=model.device)
    results["generate"] = (model.generate(prompt, max_new_tokens=4, do_sample=False)[0, 5:].tolist(),
                           backend.runner.generate(prompt, 4)[0])
    loaded = load(checkpoint, ep_size=WORLD, tp_plan=ATTENTION_TP_PLAN)  # experts split by expert
    ep_backend = enable(loaded, **CACHE)
    results["loaded_ep"], results["loaded_ep_compiled"] = scenario(ep_backend.runner), compiled(ep_backend)
    results["same_attention_shards"] = all(
        torch.equal(a.to_local(), b.to_local()) for a, b in zip(attention_shards(model), attention_shards(loaded)))
    default_plan = load(checkpoint, tp_plan=None)  # transformers' own plan: the attention replicated
    results["enable_errors"] = (indivisible_error(mesh), enable_error(default_plan))
    return results


def load(checkpoint: str, **distributed) -> DeepseekV4ForCausalLM:
    """The checkpoint whole on every rank or, with ``DistributedConfig`` arguments, each rank's
    shards as ``transformers`` reads them."""
    kwargs = {}
    if distributed:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_size=WORLD, **distributed)
    model = DeepseekV4ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, local_files_only=True, **kwargs)
    return model.eval().requires_grad_(False)


def compiled(backend) -> dict:
    """The scenario through ``compile_step`` (fullgraph, Dynamo on the eager backend, as the CPU runs
    it), its graph breaks, frames and the all-reduces in its graphs."""
    with fresh_compile_state():
        capture = GraphCapture("eager")
        logits = scenario(ModelRunner(backend, step_fn=compile_step(backend, backend=capture)))
        all_reduces = [sum(str(n.target) == "_c10d_functional.all_reduce" for n in g.graph.nodes)
                       for g in capture.graphs]
        return {"logits": logits, "graph_breaks": graph_breaks(), "frames": capture.frame_count,
                "all_reduces": all_reduces}


def scenario(runner: ModelRunner, keep: bool = False):
    """Logits (fp32) of chunked prefills (requests a and b, chunks of 32 + 24 and 12 + 8 tokens), a
    mixed step (a decodes beside an 8-token chunk of b) and two decode steps of both; with ``keep``
    also the cache's buffers and the allocator's bookkeeping before the requests are released.

    Every step has both requests and the first scores a's rows only, so the compiled step traces one
    frame (request, row and logit-row counts all different: docs/model.md, "Zero recompiles")."""
    a, b = ids(60, seed=1), ids(30, seed=2)
    ra, rb = runner.admit(), runner.admit()
    prefill = [step(runner, {ra: a[:32], rb: b[:12]}, scored=32), step(runner, {ra: a[32:56], rb: b[12:20]})]
    logits = {"prefill": torch.cat(prefill), "mixed": step(runner, {ra: a[56:57], rb: b[20:28]})}
    logits["decode"] = torch.cat([step(runner, {ra: a[t:t + 1], rb: b[t - 29:t - 28]}, ForwardMode.DECODE)
                                  for t in (57, 58)])
    state = (snapshot(runner), allocator_state(runner.allocator)) if keep else ()
    runner.release(ra)
    runner.release(rb)
    return (logits, *state) if keep else logits


def step(runner: ModelRunner, tokens: dict[int, list[int]], mode: ForwardMode = ForwardMode.EXTEND,
         scored: int | None = None) -> torch.Tensor:
    """One bucketed step feeding ``tokens[row]`` to each row: the logits (fp32) of the first ``scored``
    fed rows (all by default)."""
    built = runner.build_step(mode, {row: len(t) for row, t in tokens.items()})
    fed = [t for toks in tokens.values() for t in toks]
    scored = len(fed) if scored is None else scored
    return runner.run_step(built, fed, list(range(scored)))[:scored].float()


def ids(n: int, seed: int) -> list[int]:
    """``n`` token ids drawn from ``seed``."""
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def snapshot(runner: ModelRunner) -> dict[str, torch.Tensor]:
    """A copy of every buffer of the runner's cache (pools, rings, index maps)."""
    return {name: t.clone() for name, t in runner.allocator.cache.state_dict().items()}


def allocator_state(allocator) -> dict:
    """The allocator's requests (length, high water, pages) and free lists."""
    requests = {row: (r.seq_len, r.high_water, r.full_pages, r.swa_pages) for row, r in allocator._requests.items()}
    return {"requests": requests, "free": (allocator._free_rows, allocator._free_full, allocator._free_swa)}


def attention_shards(model) -> list[torch.Tensor]:
    """The attention's DTensor parameters, in the model's order."""
    return [p for name, p in model.named_parameters() if ".self_attn." in name and isinstance(p, DTensor)]


def forward(model) -> torch.Tensor:
    """The model's own forward (the backend's, once enabled) of a 20-token row: logits fp32."""
    return model(torch.tensor([ids(20, seed=4)], device=model.device)).logits[0].float()


def transformers_forward_error(model) -> str:
    """What a call that would run ``transformers``' own forward (positions with an offset) says on a
    sharded model."""
    try:
        model(torch.tensor([ids(4, seed=5)], device=model.device), position_ids=torch.arange(1, 5)[None])
    except ValueError as e:
        return str(e)
    return "no error"


def indivisible_error(mesh) -> str:
    """What ``enable`` says for a model whose one output group cannot be split over 2 ranks."""
    return enable_error(tiny_hf_model(config=tiny_hf_config(num_hidden_layers=1, o_groups=1)), device_mesh=mesh)


def enable_error(model, **kwargs) -> str:
    """The ``ValueError`` of ``enable(model, ...)``."""
    try:
        enable(model, **CACHE, **kwargs)
    except ValueError as e:
        return str(e)
    return "no error"
