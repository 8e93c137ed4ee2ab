"""A miniature serving loop around a :class:`DSV4AttentionStack`: what an engine does between
steps (admit, allocate pages, build the step object, pad to a bucket, roll back rejected drafts),
plus an oracle check of every step. Used by the demo (``python -m dsv4_compile``), the tests and
the benchmarks.

Hidden states of new tokens are drawn from a seeded generator and kept per request, so the
cache-free oracle can recompute any request from its full history. With ``capture_layers`` (eager
forwards only) the engine also records every layer's input rows per request, so each layer can be
checked against the oracle on exactly the inputs it saw ("teacher forcing"): that isolates a
layer's error from the bf16 drift the residual stream accumulates across layers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from .allocator import PageAllocator
from .layer import DSV4AttentionStack
from .compile import REQUEST_BUCKETS, TOKEN_BUCKETS, bucket
from .config import PAGE_SIZE, SWA_WINDOW
from .layout import INDEX_PAGE_SIZE
from .oracle import oracle_cache_entries, oracle_layer, oracle_layer_inputs, oracle_stack
from .reference.kv_store import gather_index_k, gather_model1
from .step import ForwardMode, StepInputs

Forward = Callable[[torch.Tensor, StepInputs], torch.Tensor]


class Engine:
    """Drives ``forward(x, step)`` (the stack itself, or a compiled version of it)."""

    def __init__(self, stack: DSV4AttentionStack, *, seed: int = 0, forward: Forward | None = None,
                 x_scale: float = 0.25, capture_layers: bool = True, bucketed: bool = False):
        self.stack = stack
        self.bucketed = bucketed  # pad every step to REQUEST_BUCKETS / TOKEN_BUCKETS
        self.x_scale = x_scale  # residual-stream scale of the random inputs
        self.forward = forward or stack
        self.allocator = PageAllocator(stack.cache)
        self.device = stack.cache.device
        self._gen = torch.Generator().manual_seed(seed)
        self.history: dict[int, torch.Tensor] = {}  # row -> [L, hidden] bf16 inputs so far
        self.layer_history: dict[int, list[torch.Tensor]] = {}  # row -> per layer [L, hidden] inputs
        self.layer_outputs: dict[int, list[torch.Tensor]] = {}  # row -> per layer last step's outputs
        self._step_io: list[tuple[torch.Tensor, torch.Tensor]] = []
        if capture_layers:
            for layer in stack.layers:
                layer.register_forward_hook(self._record_layer)

    def _record_layer(self, module, args, output) -> None:
        self._step_io.append((args[0].detach().clone(), output.detach().clone()))

    # -- request lifecycle ---------------------------------------------------------------------
    def admit(self) -> int:
        row = self.allocator.admit()
        empty = torch.zeros(0, self.stack.config.hidden_size, dtype=torch.bfloat16, device=self.device)
        self.history[row] = empty
        self.layer_history[row] = [empty] * len(self.stack.layers)
        return row

    def release(self, row: int) -> None:
        self.allocator.free(row)
        del self.history[row], self.layer_history[row]
        self.layer_outputs.pop(row, None)

    def accept(self, row: int, num_accepted: int, num_drafts: int) -> None:
        """After a verify step of ``num_drafts`` tokens, keep the first ``num_accepted``."""
        new_len = self.allocator.seq_len(row) - num_drafts + num_accepted
        self.allocator.truncate(row, new_len)
        self.history[row] = self.history[row][:new_len]
        self.layer_history[row] = [h[:new_len] for h in self.layer_history[row]]

    # -- steps ---------------------------------------------------------------------------------
    def build_step(self, mode: ForwardMode, tokens: Mapping[int, int], *, pad_requests: int = 0,
                   pad_tokens: int = 0) -> tuple[torch.Tensor, StepInputs]:
        """Allocate ``tokens[row]`` new positions per request and return ``(x, step)``, padded to
        ``pad_requests`` requests and ``pad_tokens`` rows (the bucket sizes) when larger."""
        rows, seq_lens, ext, locs, xs = [], [], [], [], []
        for row, n in tokens.items():
            locs.append(self.allocator.extend(row, n))
            x_new = (self.x_scale * torch.randn(n, self.stack.config.hidden_size, generator=self._gen)).to(
                self.device, torch.bfloat16)
            self.history[row] = torch.cat([self.history[row], x_new])
            rows.append(row)
            seq_lens.append(self.allocator.seq_len(row))
            ext.append(n)
            xs.append(x_new)
        if self.bucketed:
            pad_requests = max(pad_requests, bucket(len(rows), REQUEST_BUCKETS))
            pad_tokens = max(pad_tokens, bucket(sum(ext), TOKEN_BUCKETS))
        pad_b = max(0, pad_requests - len(rows))
        rows, seq_lens, ext = rows + [0] * pad_b, seq_lens + [0] * pad_b, ext + [0] * pad_b
        loc = torch.cat(locs) if locs else torch.zeros(0, dtype=torch.int64, device=self.device)
        num_tokens = max(pad_tokens, loc.shape[0])
        step = StepInputs.make(mode, rows, seq_lens, ext, loc, num_tokens=num_tokens, device=self.device)
        x = torch.zeros(num_tokens, self.stack.config.hidden_size, dtype=torch.bfloat16, device=self.device)
        if xs:
            real = torch.cat(xs)
            x[: real.shape[0]] = real
        return x, step

    def run(self, mode: ForwardMode, tokens: Mapping[int, int], **pad) -> dict[int, torch.Tensor]:
        """One step; returns each request's outputs for its new tokens (``[n, hidden]``)."""
        x, step = self.build_step(mode, tokens, **pad)
        self._step_io.clear()
        out = self.forward(x, step)
        result, lo = {}, 0
        for row, n in tokens.items():
            result[row] = out[lo:lo + n].clone()
            if self._step_io:
                self.layer_history[row] = [torch.cat([h, inp[lo:lo + n]])
                                           for h, (inp, _) in zip(self.layer_history[row], self._step_io)]
                self.layer_outputs[row] = [o[lo:lo + n] for _, o in self._step_io]
            lo += n
        return result

    def idle(self, num_tokens: int = 1) -> torch.Tensor:
        """A step with no request: every row is padding. Returns the (throw-away) outputs."""
        step = StepInputs.idle(num_tokens, device=self.device)
        x = torch.zeros(num_tokens, self.stack.config.hidden_size, dtype=torch.bfloat16, device=self.device)
        self._step_io.clear()
        return self.forward(x, step).clone()

    # -- oracle --------------------------------------------------------------------------------
    @torch.no_grad()
    def oracle_error(self, outputs: Mapping[int, torch.Tensor]) -> float:
        """Max |paged - oracle| over the rows of ``outputs`` (each request's last rows), relative
        to the largest attention contribution ``|oracle - x|`` among them."""
        err, scale = 0.0, 0.0
        for row, got in outputs.items():
            x = self.history[row][-got.shape[0]:].float()
            want = oracle_stack(self.stack, self.history[row])[-got.shape[0]:].float()
            err = max(err, (got.float() - want).abs().max().item())
            scale = max(scale, (want - x).abs().max().item())
        return err / max(scale, 1e-6)

    @torch.no_grad()
    def layer_errors(self, rows) -> list[float]:
        """Per layer: max |paged - oracle| / max |oracle| of the last step's outputs of ``rows``,
        the oracle run on the very inputs each layer saw (needs ``capture_layers``)."""
        errs = [0.0] * len(self.stack.layers)
        for row in rows:
            for i, (layer, got) in enumerate(zip(self.stack.layers, self.layer_outputs[row])):
                want = oracle_layer(layer, self.layer_history[row][i])[-got.shape[0]:].float()
                rel = (got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6)
                errs[i] = max(errs[i], rel.item())
        return errs

    @torch.no_grad()
    def cache_error(self, row: int) -> dict[str, float]:
        """Errors of request ``row``'s cached entries against the oracle, per pool kind over all
        layers (the SWA window keys, every compressed entry, every indexer key): ``kind`` is
        max |cached - oracle| / max |oracle| and ``kind_rms`` is ||cached - oracle|| / ||oracle||."""
        cache = self.stack.cache
        hs = self.layer_history[row] if row in self.layer_outputs else oracle_layer_inputs(
            self.stack, self.history[row])
        L = hs[0].shape[0]
        tokens = cache.req_to_token[row, :L].long()
        errors: dict[str, float] = {}

        def record(kind: str, got: torch.Tensor, want: torch.Tensor) -> None:
            diff, want = got.float() - want.float(), want.float()
            rel_max = diff.abs().max() / want.abs().max().clamp_min(1e-6)
            rel_rms = diff.norm() / want.norm().clamp_min(1e-6)
            errors[kind] = max(errors.get(kind, 0.0), rel_max.item())
            errors[kind + "_rms"] = max(errors.get(kind + "_rms", 0.0), rel_rms.item())

        for layer, layer_cache, h in zip(self.stack.layers, cache.layers, hs):
            want = oracle_cache_entries(layer, h)
            swa_slots = cache.full_to_swa[tokens[max(0, L - SWA_WINDOW):]]
            record("swa", gather_model1(layer_cache.swa_kv, swa_slots, PAGE_SIZE), want["swa"])
            if layer.ratio and want["extra"].shape[0]:
                r = layer.ratio
                slots = tokens[::r][: want["extra"].shape[0]] // r
                record(f"c{r}", gather_model1(layer_cache.extra_kv, slots, layer_cache.extra_page_size),
                       want["extra"])
            if layer.ratio == 4 and want["index_k"].shape[0]:
                slots = tokens[::4][: want["index_k"].shape[0]] // 4
                record("index_k", gather_index_k(layer_cache.index_k, slots, INDEX_PAGE_SIZE),
                       want["index_k"])
        return errors
