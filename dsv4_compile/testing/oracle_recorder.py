"""An :class:`~dsv4_compile.engine.Engine`'s steps against the cache-free oracle
(docs/semantics.md §4.7), for the tests and the demo.

:class:`OracleRecorder` feeds an engine seeded hidden states and keeps each request's history of
them, so the oracle can recompute any request from its full history. With ``capture_layers``
(eager forwards only) it also records every layer's input rows per request, so each layer can be
checked against the oracle on exactly the inputs it saw ("teacher forcing"): that isolates a
layer's error from the bf16 drift the residual stream accumulates across layers.

Histories follow the engine's allocator: a request's history is cut back to its length before
each step it takes part in, so rejected drafts and rows reused by a new request leave no trace.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..cache import DSV4Cache, LayerCache
from ..config import PAGE_SIZE, SWA_WINDOW, DSV4AttnConfig
from ..engine import Engine
from ..layer import DSV4AttentionStack
from ..layout import INDEX_PAGE_SIZE
from ..oracle import oracle_cache_entries, oracle_layer, oracle_layer_inputs, oracle_stack
from ..reference.kv_store import gather_index_k, gather_model1
from ..step import ForwardMode

STACK_RTOL = 0.05  # end-to-end bound of output_error: bf16 drift of the residual stream across layers
# (meaningful while no indexer selects among more than top-k entries, see indexer_selects)


class OracleRecorder:
    """Seeded inputs for ``engine``'s steps, what each request saw, and its errors against the oracle.

    ``x_scale`` is the residual-stream scale of the random inputs; ``capture_layers`` hooks every
    layer of the stack to record its inputs and outputs (leave it off when the engine's forward
    will be compiled).
    """

    def __init__(self, engine: Engine, *, seed: int = 0, x_scale: float = 0.25, capture_layers: bool = True):
        self.engine = engine
        self.stack = engine.stack
        self.x_scale = x_scale
        self._gen = torch.Generator().manual_seed(seed)
        self._history: dict[int, torch.Tensor] = {}  # row -> [L, hidden] bf16 inputs so far
        self._layer_history: dict[int, list[torch.Tensor]] = {}  # row -> per layer [L, hidden] inputs
        self._layer_outputs: dict[int, list[torch.Tensor]] = {}  # row -> per layer last step's outputs
        self._step_io: list[tuple[torch.Tensor, torch.Tensor]] = []
        if capture_layers:
            for layer in self.stack.layers:
                layer.register_forward_hook(self._record_layer)

    def _record_layer(self, module, args, output) -> None:
        self._step_io.append((args[0].detach().clone(), output.detach().clone()))

    # -- steps ---------------------------------------------------------------------------------
    def draw(self, tokens: Mapping[int, int]) -> dict[int, torch.Tensor]:
        """New hidden states ``[tokens[row], hidden] bf16`` per request, not recorded (see :meth:`run`)."""
        hidden, device = self.stack.config.hidden_size, self.engine.device
        return {row: (self.x_scale * torch.randn(n, hidden, generator=self._gen)).to(device, torch.bfloat16)
                for row, n in tokens.items()}

    def run(self, mode: ForwardMode, tokens: Mapping[int, int], **pad) -> dict[int, torch.Tensor]:
        """One engine step of ``tokens[row]`` drawn tokens per request; records the inputs (and,
        when captured, every layer's inputs and outputs) and returns the engine's outputs."""
        inputs = self.draw(tokens)
        self._step_io.clear()
        outputs = self.engine.run(mode, inputs, **pad)
        self._record(inputs)
        return outputs

    def _record(self, inputs: Mapping[int, torch.Tensor]) -> None:
        """Append the step's inputs (and captured layer rows) to each request's history, cut back
        first to the request's length before the step."""
        lo = 0
        for row, x in inputs.items():
            n = x.shape[0]
            start = self.engine.allocator.seq_len(row) - n
            past = self._history.get(row, x[:0])
            if past.shape[0] < start:
                raise RuntimeError(f"request {row} holds {start} tokens before this step but only "
                                   f"{past.shape[0]} were fed through this recorder")
            self._history[row] = torch.cat([past[:start], x])
            layer_history = self._layer_history.get(row) if start else [x[:0]] * len(self._step_io)
            if self._step_io and layer_history and layer_history[0].shape[0] >= start:
                self._layer_history[row] = [torch.cat([h[:start], inp[lo:lo + n]])
                                            for h, (inp, _) in zip(layer_history, self._step_io)]
                self._layer_outputs[row] = [o[lo:lo + n] for _, o in self._step_io]
            else:  # not captured now or at an earlier step: the oracle recomputes the layer inputs
                self._layer_history.pop(row, None)
                self._layer_outputs.pop(row, None)
            lo += n

    def history(self, row: int) -> torch.Tensor:
        """``[L, hidden] bf16``: every input of request ``row`` (L = its current length)."""
        return self._history[row][: self.engine.allocator.seq_len(row)]

    def indexer_selects(self, row: int) -> bool:
        """Whether request ``row``'s last position sees more c4 entries than the indexer keeps
        (top-k), in a stack with ratio-4 layers: there one ulp of upstream drift can change the
        selection, so only per-layer (teacher-forced) errors are meaningful, not end-to-end ones."""
        config = self.stack.config
        return 4 in config.compress_ratios and self.engine.allocator.seq_len(row) // 4 > config.index_topk

    def teacher_forced(self, row: int) -> bool:
        """Whether every layer's inputs of ``row`` were captured (else the oracle recomputes them)."""
        return row in self._layer_outputs

    def layer_inputs(self, row: int) -> list[torch.Tensor]:
        """Per layer, ``[L, hidden]``: the inputs it saw for request ``row`` (captured, or the
        oracle's from the raw inputs)."""
        if not self.teacher_forced(row):
            return oracle_layer_inputs(self.stack, self.history(row))[:-1]
        length = self.engine.allocator.seq_len(row)
        return [h[:length] for h in self._layer_history[row]]

    # -- errors against the oracle -------------------------------------------------------------
    @torch.no_grad()
    def output_error(self, outputs: Mapping[int, torch.Tensor]) -> float:
        """Max |paged - oracle| over the rows of ``outputs`` (each request's last rows), relative
        to the largest attention contribution ``|oracle - x|`` among them. The oracle starts from
        the raw inputs, so this includes the drift of the residual stream across layers and, where
        :meth:`indexer_selects`, the selections that drift flips: judge long runs by
        :meth:`layer_errors` and :meth:`cache_errors` instead."""
        err, scale = 0.0, 0.0
        for row, got in outputs.items():
            history = self.history(row)
            x = history[-got.shape[0]:].float()
            want = oracle_stack(self.stack, history)[-got.shape[0]:].float()
            err = max(err, (got.float() - want).abs().max().item())
            scale = max(scale, (want - x).abs().max().item())
        return err / max(scale, 1e-6)

    @torch.no_grad()
    def layer_errors(self, rows) -> list[float]:
        """Per layer: max |paged - oracle| / max |oracle| of the last step's outputs of ``rows``,
        the oracle run on the very inputs each layer saw (``rows`` must be teacher forced)."""
        errs = [0.0] * len(self.stack.layers)
        for row in rows:
            inputs = self.layer_inputs(row)
            for i, (layer, got) in enumerate(zip(self.stack.layers, self._layer_outputs[row])):
                want = oracle_layer(layer, inputs[i])[-got.shape[0]:].float()
                rel = (got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6)
                errs[i] = max(errs[i], rel.item())
        return errs

    @torch.no_grad()
    def cache_errors(self, row: int) -> dict[str, float]:
        """Errors of request ``row``'s cached entries against the oracle, per pool kind over all
        layers (the SWA window keys, every compressed entry, every indexer key): ``kind`` is
        max |cached - oracle| / max |oracle| and ``kind_rms`` is ||cached - oracle|| / ||oracle||
        over all entries; ``kind_entry`` is the worst entry's own ||cached - oracle|| / ||oracle||
        (one wrong entry among many barely moves the other two)."""
        cache = self.stack.cache
        inputs = self.layer_inputs(row)
        tokens = cache.req_to_token[row, : inputs[0].shape[0]].long()
        errors: dict[str, float] = {}
        for layer, layer_cache, h in zip(self.stack.layers, cache.layers, inputs):
            pairs = _cached_and_oracle_entries(cache, layer_cache, tokens, oracle_cache_entries(layer, h))
            for kind, (got, want) in pairs.items():
                diff, want = got.float() - want.float(), want.float()
                worst = {kind: diff.abs().max() / want.abs().max().clamp_min(1e-6),
                         kind + "_rms": diff.norm() / want.norm().clamp_min(1e-6),
                         kind + "_entry": (diff.norm(dim=1) / want.norm(dim=1).clamp_min(1e-6)).max()}
                for name, err in worst.items():
                    errors[name] = max(errors.get(name, 0.0), err.item())
        return errors


def _cached_and_oracle_entries(cache: DSV4Cache, layer_cache: LayerCache, tokens: torch.Tensor,
                               want: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per pool kind of one layer (``swa``, ``c4`` / ``c128``, ``index_k``): the request's cached
    entries, gathered through its full slots ``tokens [L]``, and the oracle's ``want`` for them."""
    length = tokens.shape[0]
    swa_slots = cache.full_to_swa[tokens[max(0, length - SWA_WINDOW):]]
    pairs = {"swa": (gather_model1(layer_cache.swa_kv, swa_slots, PAGE_SIZE), want["swa"])}
    ratio = layer_cache.ratio
    if ratio and want["extra"].shape[0]:
        slots = tokens[::ratio][: want["extra"].shape[0]] // ratio
        pairs[f"c{ratio}"] = (gather_model1(layer_cache.extra_kv, slots, layer_cache.extra_page_size),
                              want["extra"])
    if ratio == 4 and want["index_k"].shape[0]:
        slots = tokens[::4][: want["index_k"].shape[0]] // 4
        pairs["index_k"] = (gather_index_k(layer_cache.index_k, slots, INDEX_PAGE_SIZE), want["index_k"])
    return pairs


def make_engine(config: DSV4AttnConfig, *, max_requests: int = 4, max_seq_len: int = 1024, seed: int = 0,
                device=None, capture_layers: bool = True, **cache_kwargs) -> tuple[Engine, OracleRecorder]:
    """A seeded stack and cache, an engine serving them and a recorder feeding it (inputs seeded
    with ``seed + 1``). ``cache_kwargs`` go to :class:`DSV4Cache`."""
    cache = DSV4Cache(config, max_requests=max_requests, max_seq_len=max_seq_len, device=device,
                      **cache_kwargs)
    stack = DSV4AttentionStack(config, cache).reset_parameters(seed).to(device)
    engine = Engine(stack)
    return engine, OracleRecorder(engine, seed=seed + 1, capture_layers=capture_layers)
