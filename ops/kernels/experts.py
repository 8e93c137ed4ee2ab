"""Triton kernels of ``dsv4::routed_experts`` for a decode step's few slots, and of the routers.

At a handful of tokens the routed experts are bound by reading their weights: a grouped GEMM
sorts the slots by expert, computes group offsets and pads each group to a GEMM tile, several
launches that together read the active experts at well under HBM bandwidth (on the H200, 227 µs
for a b = 1 step of the 4-layer benchmark model whose active experts' bytes need 84 µs). Here two
launches do the whole layer, with no sort:

* ``_gate_up_kernel``, grid ``(min(E, S), cdiv(I, BLOCK_N))``: program ``(i, n)`` takes the
  ``i``-th distinct expert ``e`` the slots name (in slot order), streams rows
  ``[n * BLOCK_N, +BLOCK_N)`` of its gate and up weights once and multiplies them with every slot
  routed to ``e`` (all ``S`` slots form the tile's rows, those of other experts masked out: at
  S <= :data:`MAX_SLOTS` the wasted tensor-core work costs nothing beside the weight bytes), then
  applies the SwiGLU and writes those slots' hidden columns.
* ``_down_kernel``, the same grid over ``down`` for the hidden activations, writing each slot's
  output row.

``dsv4::moe_experts`` adds rows of programs to both grids: the shared expert's (every token) and,
in the first, the router's logits (``BLOCK_N`` of its weight's rows a program), so their weights
stream beside the routed experts' instead of in launches of their own.

On sm_90+ both launches use programmatic dependent launch (:data:`WEIGHT_PREFETCH`): a program
starts while the kernel before it still runs, asks the L2 for the first bytes of the weight rows
it already knows it will read, then waits for that kernel's output; so the first DRAM round trips
overlap the kernel before, as the projections' launches do (``linear.py``). The gate/up kernel
knows the shared expert's and the router's rows, and a hash-routed layer's experts (its table and
the token ids are final before the kernel before it runs; a learned router's choice is that
kernel's output); the down kernel knows all of its rows, since the gate/up kernel lets it launch
only past its own wait. ``router_topk``'s two launches chain the same way: the product's programs
prefetch their span of the router's weight, and the selecting kernel lets the experts' launch
start once the partials are in.

``_topk_indices_kernel`` (``dsv4::topk_indices``, the router's choice of experts): one program per
row holds the row's scores as order-preserving integer keys and takes the largest ``k`` times, the
lowest column among equal keys each time. ``dsv4::router_topk`` (a learned router whole) is
``_router_partial_kernel``, the product split over experts and H into fp32 partials, then
``_router_topk_kernel``, a program per token that sums its partials, scores and selects as
``_topk_indices_kernel`` does.

The grid has one row of programs per expert the slots can reach, not per expert of the layer: a
model of 256 experts launches 6 rows at one token, not 256 of which 250 would start only to exit.
A program whose ``i`` is past the distinct experts reads nothing (its loop runs zero times), so a
layer reads only its active experts. Every slot's row is written by exactly one program: its
expert's, or the ``i = 0`` programs for an id outside ``[0, E)`` (zeros). Rounding follows the
reference (``dsv4_compile/reference/experts.py``): fp32 accumulation, the activations' dtype at
each of transformers' rounding points.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host import has_pdl, num_sms, prefetch_columns
from .primitives import DOT_MIN_ROWS, TileConfig, dependent_launch, prefetch_rows_l2, prefetch_then_wait, unsigned_key

# Slots (tokens x experts per token) up to which the kernels run; a larger step (prefill) is a
# GEMM, which the grouped path does better. Every program holds all slots as its tile's rows.
MAX_SLOTS = 64


@triton.jit
def _slot_rows(ids_ptr, tok_ptr, S, E, V, TOPK, S_PAD: tl.constexpr, HASH: tl.constexpr):
    """``(slots [S_PAD], ids [S_PAD], e, served, hit [S_PAD])``: the slots and their ids (padding
    id -1); the expert ``e`` of program ``program_id(0) = i``, the ``i``-th distinct id in
    ``[0, E)`` in slot order (``served`` False and ``e`` 0 past the last, so that pointers built
    from ``e`` stay inside the weights); which slots it serves (none when not ``served``).
    ``HASH``: ``ids_ptr`` is a hash table ``[V, TOPK]`` and slot ``s`` takes column ``s % TOPK`` of
    row ``tok[s // TOPK]`` (id -1 for a token id outside ``[0, V)``, whose row is not read)."""
    slots = tl.arange(0, S_PAD)
    if HASH:
        tok = tl.load(tok_ptr + slots // TOPK, mask=slots < S, other=-1).to(tl.int64)
        listed = (slots < S) & (tok >= 0) & (tok < V)
        ids = tl.load(ids_ptr + tok * TOPK + slots % TOPK, mask=listed, other=-1)
    else:
        ids = tl.load(ids_ptr + slots, mask=slots < S, other=-1)
    owned = (ids >= 0) & (ids < E)
    # a slot is its id's first when no earlier slot holds the same id
    earlier_same = (ids[:, None] == ids[None, :]) & (slots[None, :] < slots[:, None])
    first = owned & (tl.max(earlier_same.to(tl.int32), axis=1) == 0)
    rank = tl.cumsum(first.to(tl.int32), axis=0) - 1  # of a first slot: how many distinct ids precede it
    e = tl.max(tl.where(first & (rank == tl.program_id(0)), ids, -1), axis=0)
    return slots, ids, tl.maximum(e, 0), e >= 0, owned & (ids == e)


@triton.jit
def _swiglu(gate, up, limit, dtype: tl.constexpr):
    """fp32 gate and up products -> the hidden activations in ``dtype``, rounded at transformers'
    rounding points: the GEMM output, the clamps, SiLU and the product."""
    gate = tl.minimum(gate.to(dtype).to(tl.float32), limit)
    up = tl.minimum(tl.maximum(up.to(dtype).to(tl.float32), -limit), limit)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (silu * up).to(dtype)


@triton.jit
def _products(a_rows, a_ok, w1_rows, w2_rows, w1_ok, w2_ok, K, S_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, PAIR: tl.constexpr):
    """``(a @ w1.T, a @ w2.T)`` fp32 ``[S_PAD, BLOCK_N]`` each, over K: ``a_rows [S_PAD, 1]`` and the
    weights' ``[BLOCK_N, 1]`` row pointers, masked by ``a_ok`` / ``w1_ok`` / ``w2_ok`` (a weight
    whose rows are all masked is not read, and its product is 0). Without ``PAIR`` only ``w1`` is
    read and the second product is 0."""
    acc1 = tl.zeros((S_PAD, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((S_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_rows + ks[None, :], mask=a_ok[:, None] & k_ok[None, :], other=0.0)
        w1 = tl.load(w1_rows + ks[None, :], mask=w1_ok[:, None] & k_ok[None, :], other=0.0)
        acc1 = tl.dot(a, tl.trans(w1), acc1)
        if PAIR:
            w2 = tl.load(w2_rows + ks[None, :], mask=w2_ok[:, None] & k_ok[None, :], other=0.0)
            acc2 = tl.dot(a, tl.trans(w2), acc2)
    return acc1, acc2


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, tok_ptr, w_ptr, h_ptr, sg_ptr, su_ptr, hs_ptr, router_ptr, logits_ptr, T, S, E,
                    V, TOPK, H, I, IS, E_R, limit, stride_x, stride_we, stride_wn, stride_h,
                    S_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SHARED: tl.constexpr,
                    ROUTER: tl.constexpr, HASH: tl.constexpr, PREFETCH_K: tl.constexpr):
    """``h[s, n-tile] = swiglu(x[s // TOPK] @ gate_up[e, {n-tile, I + n-tile}].T)`` for the slots of
    program ``i``'s expert ``e``. ``SHARED``: the next row of programs is the shared expert,
    ``hs[t, n-tile] = swiglu(x[t] @ {sg, su}[n-tile].T)`` for every token (``sg``, ``su [IS, H]``).
    ``ROUTER``: the last row computes the router's logits, ``logits[t, n-tile] = x[t] @
    router[n-tile].T`` (``router [E_R, H]``, ``logits [T, E_R]`` of ``h``'s dtype). The three kinds of
    rows share one K loop (one set of pipeline buffers, which three loops would exceed).
    ``PREFETCH_K > 0``: launched with PDL; before waiting for the kernel before it (whose output is
    x, and without ``HASH`` the slots' ids) a program asks the L2 for the first ``PREFETCH_K``
    columns of the weight rows it knows it will read: the shared expert's, the router's, and with
    ``HASH`` its routed expert's (the table and the token ids are final before that kernel runs)."""
    row = tl.program_id(0)
    dtype = h_ptr.dtype.element_ty
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_router = ROUTER and row == tl.num_programs(0) - 1
    is_shared = SHARED and row == tl.num_programs(0) - 1 - ROUTER
    if HASH:
        slots, ids, e, served, hit = _slot_rows(ids_ptr, tok_ptr, S, E, V, TOPK, S_PAD, HASH)
    if PREFETCH_K > 0:
        if is_router:
            prefetch_rows_l2(router_ptr + cols.to(tl.int64)[:, None] * H, cols < E_R, router_ptr, 0, H, PREFETCH_K)
        elif is_shared:
            prefetch_rows_l2(sg_ptr + cols.to(tl.int64)[:, None] * H, cols < IS, sg_ptr, 0, H, PREFETCH_K)
            prefetch_rows_l2(su_ptr + cols.to(tl.int64)[:, None] * H, cols < IS, su_ptr, 0, H, PREFETCH_K)
        elif HASH:
            w_gate = w_ptr + e.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn
            prefetch_rows_l2(w_gate, served & (cols < I), w_ptr, 0, H, PREFETCH_K)
            prefetch_rows_l2(w_gate + I * stride_wn, served & (cols < I), w_ptr, 0, H, PREFETCH_K)
    dependent_launch(PREFETCH_K > 0)
    if not HASH:
        slots, ids, e, served, hit = _slot_rows(ids_ptr, tok_ptr, S, E, V, TOPK, S_PAD, HASH)
    tokens = slots
    t_ok = tokens < T
    if is_router:
        # one product: the second weight's rows are all masked off, so it is not read
        a_rows, a_ok, col_ok, w2_ok, k = tokens, t_ok, cols < E_R, cols < 0, H
        w1 = router_ptr + cols.to(tl.int64)[:, None] * H
        w2 = w1
    elif is_shared:
        a_rows, a_ok, col_ok, k = tokens, t_ok, cols < IS, H
        w2_ok = col_ok
        w1 = sg_ptr + cols.to(tl.int64)[:, None] * H
        w2 = su_ptr + cols.to(tl.int64)[:, None] * H
    else:
        # past the distinct experts: read nothing
        a_rows, a_ok, col_ok, k = slots // TOPK, hit, cols < I, tl.where(served, H, 0)
        w2_ok = col_ok
        w1 = w_ptr + e.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn
        w2 = w1 + I * stride_wn
    gate, up = _products(x_ptr + a_rows.to(tl.int64)[:, None] * stride_x, a_ok, w1, w2, col_ok, w2_ok, k, S_PAD,
                         BLOCK_N, BLOCK_K, True)
    if is_router:
        tl.store(logits_ptr + tokens.to(tl.int64)[:, None] * E_R + cols[None, :], gate.to(dtype),
                 mask=t_ok[:, None] & col_ok[None, :])
    elif is_shared:
        tl.store(hs_ptr + tokens.to(tl.int64)[:, None] * IS + cols[None, :], _swiglu(gate, up, limit, dtype),
                 mask=t_ok[:, None] & col_ok[None, :])
    else:
        tl.store(h_ptr + slots.to(tl.int64)[:, None] * stride_h + cols[None, :], _swiglu(gate, up, limit, dtype),
                 mask=hit[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, ids_ptr, tok_ptr, w_ptr, out_ptr, hs_ptr, sd_ptr, out_s_ptr, T, S, E, V, TOPK, H, I, IS,
                 stride_h, stride_we, stride_wn, stride_out,
                 S_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SHARED: tl.constexpr,
                 HASH: tl.constexpr, PREFETCH_K: tl.constexpr):
    """``out[s, n-tile] = h[s] @ down[e, n-tile].T`` for the slots of expert ``e``; the ``i = 0``
    programs also write zeros for slots whose id is outside ``[0, E)``. ``SHARED``: the last row of
    programs is the shared expert, ``out_s[t, n-tile] = hs[t] @ sd[n-tile].T`` (``sd [H, IS]``).
    ``PREFETCH_K > 0``: launched with PDL after the gate/up kernel (launched so too, which lets it
    launch once past its own wait: the slots' ids are final by then); a program asks the L2 for
    the first ``PREFETCH_K`` columns of its weight rows, then waits for the hidden activations."""
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    if SHARED and tl.program_id(0) == tl.num_programs(0) - 1:
        tokens = tl.arange(0, S_PAD)
        t_ok = tokens < T
        w_rows = sd_ptr + cols.to(tl.int64)[:, None] * IS
        prefetch_then_wait(w_rows, col_ok, sd_ptr, 0, IS, PREFETCH_K)
        acc, _ = _products(hs_ptr + tokens.to(tl.int64)[:, None] * IS, t_ok, w_rows, w_rows, col_ok, col_ok, IS,
                           S_PAD, BLOCK_N, BLOCK_K, False)
        tl.store(out_s_ptr + tokens.to(tl.int64)[:, None] * H + cols[None, :], acc.to(out_s_ptr.dtype.element_ty),
                 mask=t_ok[:, None] & col_ok[None, :])
    else:
        slots, ids, e, served, hit = _slot_rows(ids_ptr, tok_ptr, S, E, V, TOPK, S_PAD, HASH)
        w_rows = w_ptr + e.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn
        prefetch_then_wait(w_rows, served & col_ok, w_ptr, 0, I, PREFETCH_K)
        acc, _ = _products(h_ptr + slots.to(tl.int64)[:, None] * stride_h, hit, w_rows, w_rows, col_ok, col_ok,
                           tl.where(served, I, 0), S_PAD, BLOCK_N, BLOCK_K, False)
        unowned = (slots < S) & ((ids < 0) | (ids >= E)) & (tl.program_id(0) == 0)
        tl.store(out_ptr + slots.to(tl.int64)[:, None] * stride_out + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=(hit | unowned)[:, None] & col_ok[None, :])


# The TileConfig of (gate_up, down), by the most experts the slots can reach, min(E, S): with at
# most two, few programs stream weights and deep K blocks keep more bytes in flight; with more,
# shallower blocks run more programs at once. The H200's best or within 2 µs of it for each of 2
# to 64 slots over 8 experts of 4096 x 2048 and 6 to 48 over 256 (a sweep of 36 tiles each,
# docs/perf-log.md).
FEW_EXPERTS = 2
FEW_EXPERTS_CONFIGS = ((64, 256, 4, 3), (64, 256, 4, 3))
MANY_EXPERTS_CONFIGS = ((64, 64, 4, 3), (64, 64, 4, 3))
# The experts' and the learned router's kernels launched with PDL, each program first asking the L2
# for the first bytes of each weight it knows it will read (module docstring). False: launched
# without PDL or prefetch (benchmarks compare the two).
WEIGHT_PREFETCH = True


def _launch_pdl(device: torch.device) -> bool:
    """Launch with PDL and the weight prefetch: :data:`WEIGHT_PREFETCH` on a device that has PDL."""
    return WEIGHT_PREFETCH and has_pdl(device)


def launch_routed_experts(x: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                          limit: float, gate_up_config: TileConfig | None = None,
                          down_config: TileConfig | None = None) -> torch.Tensor:
    """The reference's ``routed_experts`` for ``T * K <= MAX_SLOTS`` slots: ``x [T, H]``,
    ``expert_ids [T, K]``, ``gate_up [E, 2I, H]``, ``down [E, H, I]`` -> ``[T * K, H]`` of ``x``'s dtype.
    The configs are ``(BLOCK_N, BLOCK_K, num_warps, num_stages)``; by default those above."""
    return _launch(x, expert_ids, gate_up, down, limit, gate_up_config, down_config)[0]


def launch_moe_experts(x: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                       limit: float, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                       router: torch.Tensor | None = None, gate_up_config: TileConfig | None = None,
                       down_config: TileConfig | None = None, token_ids: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`launch_routed_experts` with the shared expert ``shared = (gate [IS, H], up [IS, H],
    down [H, IS])`` applied to every token and, given ``router [E, H]``, the router's logits, in the
    same two launches (a row of programs each) -> ``(slots [T * K, H], shared_out [T, H], logits
    [T, E])`` of ``x``'s dtype (``logits`` ``[T, 0]`` without a router). With ``token_ids [T]``,
    ``expert_ids`` is a hash table ``[V, K]`` whose rows the kernels look up themselves."""
    return _launch(x, expert_ids, gate_up, down, limit, gate_up_config, down_config, shared, router, token_ids)


def _launch(x, expert_ids, gate_up, down, limit, gate_up_config, down_config, shared=None, router=None,
            token_ids=None):
    t, topk, vocab = x.shape[0], expert_ids.shape[1], expert_ids.shape[0]
    s = t * topk
    if s > MAX_SLOTS:
        raise ValueError(f"launch_routed_experts: {s} slots, the kernels take at most {MAX_SLOTS}")
    num_experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    # rows of programs: the distinct experts the slots can name (at least one: its programs write
    # the zero rows of ids outside the experts), the shared expert's, the router's
    reachable = max(1, min(num_experts, s))
    default = FEW_EXPERTS_CONFIGS if reachable <= FEW_EXPERTS else MANY_EXPERTS_CONFIGS
    gate_up_config, down_config = gate_up_config or default[0], down_config or default[1]
    x, gate_up, down = (v if v.stride(-1) == 1 else v.contiguous() for v in (x, gate_up, down))
    ids = expert_ids.contiguous()  # the slots' ids, or with token_ids the table they index
    tokens = token_ids.contiguous() if token_ids is not None else ids
    out = torch.empty(s, hidden, dtype=x.dtype, device=x.device)
    logits = torch.empty(t, router.shape[0] if router is not None else 0, dtype=x.dtype, device=x.device)
    if shared is not None:
        shared_gate, shared_up, shared_down = (w.contiguous() for w in shared)
        shared_inter = shared_gate.shape[0]
        shared_out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
        shared_h = torch.empty(t, shared_inter, dtype=x.dtype, device=x.device)
    else:  # unread
        shared_gate = shared_up = shared_down = shared_out = shared_h = x
        shared_inter = 0
    router = router.contiguous() if router is not None else None
    if s:
        h = torch.empty(s, inter, dtype=x.dtype, device=x.device)
        s_pad = max(DOT_MIN_ROWS, triton.next_power_of_2(s))
        rows = reachable + (shared is not None)
        bn, bk, warps, stages = gate_up_config
        columns = max(inter, shared_inter, logits.shape[1])
        hashed = token_ids is not None
        pdl = _launch_pdl(x.device)
        prefetch_k = prefetch_columns(hidden, bn, x.element_size()) if pdl else 0
        _gate_up_kernel[(rows + (router is not None), triton.cdiv(columns, bn))](
            x, ids, tokens, gate_up, h, shared_gate, shared_up, shared_h, router if router is not None else x, logits,
            t, s, num_experts, vocab, topk, hidden, inter, shared_inter, logits.shape[1], float(limit), x.stride(0),
            gate_up.stride(0), gate_up.stride(1), h.stride(0), S_PAD=s_pad, BLOCK_N=bn, BLOCK_K=bk,
            SHARED=shared is not None, ROUTER=router is not None, HASH=hashed, PREFETCH_K=prefetch_k,
            num_warps=warps, num_stages=stages, launch_pdl=pdl)
        bn, bk, warps, stages = down_config
        prefetch_k = prefetch_columns(max(inter, shared_inter), bn, x.element_size()) if pdl else 0
        _down_kernel[(rows, triton.cdiv(hidden, bn))](
            h, ids, tokens, down, out, shared_h, shared_down, shared_out, t, s, num_experts, vocab, topk, hidden,
            inter, shared_inter, h.stride(0), down.stride(0), down.stride(1), out.stride(0),
            S_PAD=s_pad, BLOCK_N=bn, BLOCK_K=bk, SHARED=shared is not None, HASH=hashed, PREFETCH_K=prefetch_k,
            num_warps=warps, num_stages=stages, launch_pdl=pdl)
    return out, shared_out, logits


@triton.jit
def _store_topk(x, live, cols, out_row, K: tl.constexpr, EP: tl.constexpr):
    """The ``K`` largest of a row's fp32 values ``x [EP]`` (columns ``cols`` where ``live``) stored
    as columns at ``out_row[0:K]``, descending, equal values in column order."""
    # one NaN (it ranks above +inf in the key) and one zero (+0.0: -0.0 equals it, as in a sort)
    x = tl.where(x != x, float("nan"), x + 0.0)
    key = unsigned_key(x)
    for i in tl.static_range(K):
        best = tl.max(tl.where(live, key, 0), axis=0)
        col = tl.min(tl.where(live & (key == best), cols, EP), axis=0)
        tl.store(out_row + i, col.to(tl.int64))
        live = live & (cols != col)


@triton.jit
def _topk_indices_kernel(scores_ptr, out_ptr, E, stride, K: tl.constexpr, EP: tl.constexpr):
    """Row ``pid``'s ``K`` largest columns of ``scores [T, E]`` into ``out [T, K]``, descending."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, EP)
    live = cols < E
    x = tl.load(scores_ptr + row * stride + cols, mask=live, other=0.0).to(tl.float32)
    _store_topk(x, live, cols, out_ptr + row * K, K, EP)


def launch_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``dsv4::topk_indices`` of ``scores [T, E]``, ``1 <= k <= E`` -> ``[T, k]`` int64. A row's E
    keys sit in one program's registers and the K rounds are unrolled: the op keeps E and k small
    (``ops/experts.py``)."""
    rows, cols = scores.shape
    if not 1 <= k <= cols:
        raise ValueError(f"launch_topk_indices: k={k} must be between 1 and the {cols} columns")
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    out = torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    if rows:
        ep = triton.next_power_of_2(cols)
        _topk_indices_kernel[(rows,)](scores, out, cols, scores.stride(0), K=k, EP=ep,
                                      num_warps=max(1, min(4, ep // 256)))
    return out


@triton.jit
def _softplus(x):
    """``log(1 + exp(x))`` as torch computes it: ``x`` itself above 20, ``log1p(exp(x))`` below
    (``log1p(y)`` as ``log(u) * y / (u - 1)``, ``u = 1 + y``: exact to a rounding where ``log(u)``
    alone would lose ``y`` to ``u``'s rounding)."""
    y = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + y
    return tl.where(x > 20.0, x, tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0))))


@triton.jit
def _router_partial_kernel(x_ptr, w_ptr, part_ptr, T, E, H, stride_x, k_per_split,
                           T_PAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                           PREFETCH_K: tl.constexpr):
    """Program ``(i, s)``: ``part[s, t, i-tile] = x[t, k-span] @ w[i-tile, k-span].T`` fp32 over
    split ``s``'s columns ``[s * k_per_split, +k_per_split)`` of H, for every token ``t``.
    ``PREFETCH_K > 0``: launched with PDL, it asks the L2 for its span's first ``PREFETCH_K``
    columns before it waits for x."""
    experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    tokens = tl.arange(0, T_PAD)
    k0 = tl.program_id(1) * k_per_split
    e_ok = experts < E
    prefetch_then_wait(w_ptr + experts.to(tl.int64)[:, None] * H, e_ok, w_ptr, k0, H, PREFETCH_K)
    w_rows = w_ptr + experts.to(tl.int64)[:, None] * H + k0
    acc, _ = _products(x_ptr + tokens.to(tl.int64)[:, None] * stride_x + k0, tokens < T, w_rows, w_rows, e_ok, e_ok,
                       tl.minimum(k_per_split, H - k0), T_PAD, BLOCK_E, BLOCK_K, False)
    tl.store(part_ptr + (tl.program_id(1) * T + tokens)[:, None] * E + experts[None, :], acc,
             mask=(tokens < T)[:, None] & e_ok[None, :])


@triton.jit
def _router_topk_kernel(part_ptr, bias_ptr, logits_ptr, out_ptr, T, E, splits, K: tl.constexpr, EP: tl.constexpr,
                        SPLITS_POW2: tl.constexpr, PDL: tl.constexpr):
    """Token ``pid``: its logits, the partials of every split summed (all loaded at once: one memory
    round trip, not one per split) and rounded to ``logits``' dtype, stored; then the ``K`` largest
    of ``sqrt(softplus(logit)) + bias`` into ``out [T, K]``, descending. ``PDL``: launched early,
    it waits here for the partials, then lets the experts' launch start (which prefetches the
    shared expert's weights meanwhile)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, EP)
    live = cols < E
    bias = tl.load(bias_ptr + cols, mask=live, other=0.0).to(tl.float32)  # a parameter: before the wait
    dependent_launch(PDL)
    split = tl.arange(0, SPLITS_POW2)
    parts = tl.load(part_ptr + ((split * T + row) * E)[:, None] + cols[None, :],
                    mask=(split < splits)[:, None] & live[None, :], other=0.0)
    logit = tl.sum(parts, axis=0).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * E + cols, logit, mask=live)
    _store_topk(tl.sqrt(_softplus(logit.to(tl.float32))) + bias, live, cols, out_ptr + row * K, K, EP)


# launch_router_topk: tokens up to which it runs (every program holds them all as its tile's rows),
# and its tile: (BLOCK_E experts, BLOCK_K columns, warps, stages)
ROUTER_MAX_TOKENS = 16
ROUTER_CONFIG = (16, 128, 4, 3)


def launch_router_topk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int,
                       config: TileConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``dsv4::router_topk`` for ``T <= ROUTER_MAX_TOKENS`` tokens in two launches: ``x [T, H]``,
    ``weight [E, H]`` of ``x``'s dtype, ``bias [E]`` -> ``(indices [T, k] int64, logits [T, E])``.
    The product is split over experts and over H until the grid fills the GPU's SMs (at most
    ``num_sms`` programs, so one program a token can load all its partials at once), into fp32
    partials; one program a token sums them (no split-K counters to zero), scores and selects."""
    t, hidden = x.shape
    num_experts = weight.shape[0]
    if t > ROUTER_MAX_TOKENS:
        raise ValueError(f"launch_router_topk: {t} tokens, the kernels take at most {ROUTER_MAX_TOKENS}")
    block_e, block_k, warps, stages = config or ROUTER_CONFIG
    x, weight = (v if v.stride(-1) == 1 else v.contiguous() for v in (x, weight))
    indices = torch.empty(t, k, dtype=torch.int64, device=x.device)
    logits = torch.empty(t, num_experts, dtype=x.dtype, device=x.device)
    if t:
        e_blocks = triton.cdiv(num_experts, block_e)
        k_blocks = max(1, triton.cdiv(hidden, block_k))
        k_per_split = triton.cdiv(k_blocks, max(1, min(k_blocks, num_sms(x.device) // e_blocks))) * block_k
        splits = max(1, triton.cdiv(hidden, k_per_split))
        part = torch.empty(splits, t, num_experts, dtype=torch.float32, device=x.device)
        pdl = _launch_pdl(x.device)
        prefetch_k = prefetch_columns(k_per_split, block_e, x.element_size()) if pdl else 0
        _router_partial_kernel[(e_blocks, splits)](x, weight, part, t, num_experts, hidden, x.stride(0), k_per_split,
                                                   T_PAD=DOT_MIN_ROWS, BLOCK_E=block_e, BLOCK_K=block_k,
                                                   PREFETCH_K=prefetch_k, num_warps=warps, num_stages=stages,
                                                   launch_pdl=pdl)
        ep, splits_pow2 = triton.next_power_of_2(num_experts), triton.next_power_of_2(splits)
        _router_topk_kernel[(t,)](part, bias.contiguous(), logits, indices, t, num_experts, splits, K=k, EP=ep,
                                  SPLITS_POW2=splits_pow2, PDL=pdl, num_warps=max(1, min(4, splits_pow2 * ep // 1024)),
                                  launch_pdl=pdl)
    return indices, logits
