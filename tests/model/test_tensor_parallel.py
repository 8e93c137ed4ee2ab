"""Tensor parallelism on 2 CPU processes over gloo (the ``gpu`` variants: 2 GPUs over NCCL): the
tiny model (8 heads: 4 a rank; 2 output groups: 1 a rank) sharded by ``enable(device_mesh=...)``
gives the logits of the model on one device, eager and compiled, and every rank holds the same
cache; ``transformers``' own loader with our attention plan (experts split by expert) gives them
too.

One spawn of two ranks (``tests/support/tp_worker.py``) measures everything; the tests compare what
the ranks saved.
"""

import pytest
import torch
import torch.multiprocessing as mp

from dsv4_compile.compile import MAX_FRAMES
from dsv4_compile.model import enable
from tests.support import tp_worker

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

PARTS = ("prefill", "mixed", "decode")
# The sharded model against one device, measured per part: mean |Δ logit| 0.0034-0.0050, max 0.11
# (logits up to 1.4), greedy agreement 0.98-1. The ranks add their shards' bf16 partial sums
# (o_b_proj, the experts' down_proj) where one device runs one GEMM; the FP8 cache turns the rare
# entry that lands on the other side of a rounding boundary into the larger differences. For
# scale: the FP8 oracle is 0.0027 (mean) from the paged backend on one device (test_model_step).
MEAN_TOLERANCE, MAX_TOLERANCE, AGREEMENT = 0.008, 0.2, 0.95
_TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not _TWO_GPUS, reason="needs 2 CUDA devices")])])
def ranks(request, tiny_hf_dir, tmp_path_factory) -> list[dict]:
    """What each of the 2 ranks measured (``tp_worker.measure``): CPU processes over gloo, or 2 GPUs
    over NCCL."""
    out = tmp_path_factory.mktemp("tp")
    mp.spawn(tp_worker.run_rank, args=(str(tiny_hf_dir), str(out), request.param), nprocs=tp_worker.WORLD)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(tp_worker.WORLD)]


def assert_close_to(got: dict, want: dict) -> None:
    """Every part of ``got`` within the tolerances of ``want`` (logits ``[rows, vocab]`` fp32)."""
    for p in PARTS:
        err = (got[p] - want[p]).abs()
        assert err.mean() < MEAN_TOLERANCE and err.max() < MAX_TOLERANCE, (p, err.mean().item(), err.max().item())
        assert (got[p].argmax(-1) == want[p].argmax(-1)).float().mean() >= AGREEMENT, p


def test_each_rank_holds_its_share_of_heads_and_groups(ranks):
    assert all(r["local_heads"] == (4, 1) and r["shards_own_their_storage"] for r in ranks)


def test_sharded_logits_equal_one_device_within_reduction_order_noise(ranks):
    """Prefill chunks, a mixed step (a decode beside a prefill chunk) and decodes, eager."""
    for r in ranks:
        assert_close_to(r["eager"], r["reference"])
    for p in PARTS:  # every rank gets the same logits, bit for bit (lm_head's shards are gathered)
        assert torch.equal(ranks[0]["eager"][p], ranks[1]["eager"][p])


def test_compiled_sharded_step_is_one_graph_with_one_all_reduce_per_block(ranks):
    """``compile_step`` on each rank, of the model sharded by ``enable`` and of the one loaded with
    expert parallelism: 0 graph breaks, the collectives inside the graph (an all-reduce of each
    attention layer's and each MoE layer's partial sums; the vocabulary-parallel embedding and the
    gathered logits are DTensor ops of the same graph), the eager logits bit for bit."""
    layers = 4
    for r in ranks:
        for compiled, eager in ((r["compiled"], r["eager"]), (r["loaded_ep_compiled"], r["loaded_ep"])):
            assert compiled["graph_breaks"] == 0
            assert 1 <= compiled["frames"] <= MAX_FRAMES
            assert set(compiled["all_reduces"]) == {2 * layers}
            for p in PARTS:
                assert torch.equal(compiled["logits"][p], eager[p]), p


def test_the_models_forward_and_sampling_run_on_the_mesh(ranks):
    """``model(input_ids)`` scores and ``model.generate()`` decodes through the sharded backend;
    ``runner.generate`` with sampling and no seed draws the first rank's seed on every rank, so the
    ranks keep running the same steps; a call that would run ``transformers``' own forward (which
    broadcasts its one KV head to every head of the model) raises."""
    for r in ranks:
        err = (r["forward"] - r["reference_forward"]).abs()
        assert err.mean() < MEAN_TOLERANCE and err.max() < MAX_TOLERANCE
        assert "does not run on a model whose attention heads are sharded" in r["forward_error"]
    assert ranks[0]["sampled"] == ranks[1]["sampled"] and len(ranks[0]["sampled"][0]) == 4
    hf_generate, runner_greedy = ranks[0]["generate"]  # model.generate over the backend's paged cache
    assert hf_generate == runner_greedy and ranks[1]["generate"] == ranks[0]["generate"]


def test_ranks_hold_the_same_cache_and_allocator(ranks):
    """The KV cache is replicated: each rank writes its own copy, byte for byte the same, and the
    same host code allocates the same pages on every rank."""
    first, second = ranks
    assert first["allocator"] == second["allocator"]
    assert first["cache"].keys() == second["cache"].keys()
    for name, t in first["cache"].items():
        assert torch.equal(t, second["cache"][name]), name


def test_model_loaded_sharded_with_expert_parallel_experts(ranks):
    """``from_pretrained(distributed_config=DistributedConfig(tp_size=2, ep_size=2,
    tp_plan=ATTENTION_TP_PLAN))``: the same attention shards as ``enable(device_mesh=...)`` cuts,
    and ``enable`` runs it over its own mesh (whole experts a rank: their outputs add exactly, the
    difference from one device is the attention's)."""
    for r in ranks:
        assert r["same_attention_shards"]
        assert_close_to(r["loaded_ep"], r["reference"])


def test_enable_names_what_a_mesh_cannot_run(ranks):
    """An output group that 2 ranks would cut; a model ``transformers`` loaded sharded with its own
    plan only (its attention whole on every rank)."""
    for r in ranks:
        groups, plan = r["enable_errors"]
        assert "DeepseekV4Config.o_groups=1" in groups and "tensor-parallel size 2" in groups
        assert "model.layers.0.self_attn.q_b_proj.weight is not sharded" in plan and "ATTENTION_TP_PLAN" in plan


def test_enable_refuses_a_device_mesh_that_is_not_one(tiny_hf):
    with pytest.raises(ValueError, match="device_mesh must be a 1-D DeviceMesh"):
        enable(tiny_hf, max_requests=1, max_seq_len=256, device_mesh="cpu")

