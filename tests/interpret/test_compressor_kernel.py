"""``compress_kv`` kernel (``ops/kernels/compressor.py``) vs the reference, small shapes.

Checks, for c4 (d = 128 with and without the Hadamard, d = 512) and c128 (d = 512):
* outputs of the rows that complete a window, three-way against an fp64 golden without the bf16
  rounding points: kernel error <= 2 x the reference's error + a floor;
* the other rows' outputs are finite (they are never stored);
* the state ring after the call equals the reference's exactly (the dummy request 0 excluded:
  all padding rows write its ring row 0, in no specified order);
* decode with padding rows and the first window (slots before position 0), verify (several rows
  of a request in one step), prefills longer than the ring (a row writes a ring row that another
  row of the same step still reads: the ring must be read before it is written), and a sequence
  of steps carrying the state;
* the entry kernel writing the cache itself (``launch_compress_kv_store``) writes the bytes the
  entries written by ``store_kv`` / ``store_index_k``'s kernels are, and the same ring.
"""

import pytest
import torch

from dsv4_compile import layout
from dsv4_compile.ops.kernels.compressor import launch_compress_kv, launch_compress_kv_store
from dsv4_compile.ops.kernels.kv_cache import launch_store_index_k, launch_store_kv
from dsv4_compile.reference import compressor as ref_compressor
from dsv4_compile.testing import compress_index as inputs

# (ratio, d, rotate, scenario); c128's long prefill (> 128 rows) is left to the GPU test
CASES = [(4, 128, True, "decode"), (4, 128, True, "verify"), (4, 128, True, "long_prefill"),
         (4, 128, False, "decode"), (4, 512, False, "decode"), (4, 512, False, "long_prefill"),
         (128, 512, False, "decode"), (128, 512, False, "verify")]
# (seq_lens, extend_lens, num_tokens) per scenario and ratio; ring 16 (c4) / 128 (c128)
SCENARIOS = {
    4: {"decode": ([4, 8, 13, 16, 33], [1] * 5, 7),  # p = 3: the first window (slots 0..3 empty)
        "verify": ([7, 12, 20], [4, 4, 4], 12),
        "long_prefill": ([24, 40], [24, 20], 45)},  # 24 and 20 > ring 16
    128: {"decode": ([128, 256, 300, 384], [1] * 4, 5),
          "verify": ([129, 258], [3, 4], 8)},
}


@pytest.mark.parametrize("ratio,d,rotate,scenario", CASES)
def test_compress_kv_matches_reference(device, ratio, d, rotate, scenario):
    seq, ext, num_tokens = SCENARIOS[ratio][scenario]
    gen = torch.Generator(device=device).manual_seed(ratio + d + len(scenario))
    args = inputs.compressor_args(ratio, d, seq, ext, gen, num_tokens=num_tokens, rotate=rotate,
                                  ring=16 if ratio == 4 else 128)
    assert (args["seq_lens_causal"] % ratio == 0).any()
    inputs.check_compress_kv(launch_compress_kv, args)


# (seq_lens, extend_lens) per step: the ring written by one step feeds the windows of the next
STEPS = {
    4: [([14, 5], [14, 5]),  # prefill from 0, longer than a window
        ([15, 8], [1, 3]),  # decode / chunk completing windows
        ([16, 9], [1, 1]),
        ([19, 12], [3, 3])],  # verify-sized steps
    128: [([255, 130], [5, 2]),  # tokens 250..254 / 128..129 written to the ring
          ([256, 131], [1, 1]),  # window 128..255 reads 128..254 from the ring
          ([259, 132], [3, 1])],
}


@pytest.mark.parametrize("ratio,d", [(4, 128), (128, 512)])
def test_compress_kv_steps_carry_state(device, ratio, d):
    """A sequence of steps: the kernel's ring after each equals the reference's."""
    gen = torch.Generator(device=device).manual_seed(ratio)
    state = None
    for seq, ext in STEPS[ratio]:
        args = inputs.compressor_args(ratio, d, seq, ext, gen, num_tokens=sum(ext) + 1)
        if state is not None:
            args["state"] = state
        state = inputs.check_compress_kv(launch_compress_kv, args)


@pytest.mark.parametrize("ratio,d,scenario", [(4, 128, "verify"), (4, 512, "long_prefill"), (128, 512, "verify")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compress_kv_reads_half_precision_projections(device, ratio, d, scenario, dtype):
    """kv / score straight from a bf16 / fp16 projection give the ring (the dummy request 0's
    excluded, as above) that the same values widened to fp32 give, to the bit, in the kernel and in
    the reference: the ring is fp32 either way. So are the entries from bf16 (the model's dtype);
    from fp16, the kernel compiles to other instructions, and on the H200 an entry may move by one
    bf16 rounding (seen once: one row of the c4 prefill)."""
    seq, ext, num_tokens = SCENARIOS[ratio][scenario]
    gen = torch.Generator(device=device).manual_seed(7 * ratio + d)
    args = inputs.compressor_args(ratio, d, seq, ext, gen, num_tokens=num_tokens, ring=16 if ratio == 4 else 128)
    kv, score = args["kv"].to(dtype), args["score"].to(dtype)
    ring = args["ring"]
    for run in (launch_compress_kv, ref_compressor.compress_kv):
        half = dict(args, kv=kv, score=score, state=args["state"].clone())
        wide = dict(args, kv=kv.float(), score=score.float(), state=args["state"].clone())
        got, want = run(**half).float(), run(**wide).float()
        if dtype == torch.bfloat16:
            assert torch.equal(got, want), run.__name__
        else:
            torch.testing.assert_close(got, want, atol=2 ** -8 * want.abs().max().item(), rtol=0)
        assert torch.equal(half["state"][ring:], wide["state"][ring:]), run.__name__


@pytest.mark.parametrize("ratio,d,scenario", [(4, 128, "verify"), (4, 512, "decode"), (128, 512, "verify")])
def test_compress_kv_store_writes_the_stored_entries(device, ratio, d, scenario):
    """One launch pair writing the cache (d = 128: indexer keys, d = 512: MODEL1 tokens) against
    ``compress_kv``'s kernels then the cache write's: the same cache, byte for byte, from canary
    bytes, and the same ring. Slots: window rows at scattered slots, a row at -1, one past the
    cache, and rows completing no window at valid slots (they write their entry, zeros, as the
    two launches do)."""
    seq, ext, num_tokens = SCENARIOS[ratio][scenario]
    gen = torch.Generator(device=device).manual_seed(11 * ratio + d)
    args = inputs.compressor_args(ratio, d, seq, ext, gen, num_tokens=num_tokens, ring=16 if ratio == 4 else 128)
    page_size, num_pages = 4, 4
    page_bytes = layout.model1_page_bytes(page_size) if d == 512 else layout.index_page_bytes(page_size)
    store = launch_store_kv if d == 512 else launch_store_index_k
    t = args["kv"].shape[0]
    slots = torch.randperm(num_pages * page_size, generator=gen, device=device)[:t]
    slots[1], slots[-1] = -1, num_pages * page_size  # skipped: negative, past the cache
    windows = args["seq_lens_causal"] % ratio == 0
    assert windows[2:-1].any() and not windows[2:-1].all()
    cache = torch.randint(0, 256, (num_pages, page_bytes), generator=gen, device=device, dtype=torch.uint8)
    want, got = cache.clone(), cache.clone()
    state_want, state_got = args["state"].clone(), args["state"].clone()
    store(want, slots, launch_compress_kv(**dict(args, state=state_want)), page_size)
    launch_compress_kv_store(**dict(args, state=state_got), cache=got, slots=slots, page_size=page_size)
    assert not torch.equal(want, cache)
    assert torch.equal(got, want)
    # the rings but the dummy request 0's: every padding row writes its ring row 0, in any order on a GPU
    ring = args["ring"]
    assert torch.equal(state_got[ring:], state_want[ring:])
