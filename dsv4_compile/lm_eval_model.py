"""The ``lm-eval`` model ``dsv4``: a ``transformers`` DeepSeek V4 checkpoint on the backend.

``lm-eval`` (``pip install 'dsv4-compile[eval]'``) knows a model only once the module defining it
is imported: importing this module registers ``dsv4``. On the command line, run lm-eval through
this module, with lm-eval's own arguments::

    python -m dsv4_compile.lm_eval_model --model dsv4 \\
        --model_args pretrained=DIR,max_seq_len=4096,batch_size=16,compile=true --tasks ...

In Python, ``import dsv4_compile.lm_eval_model`` before ``lm_eval.simple_evaluate(model="dsv4",
...)``. Every request runs through one :class:`~dsv4_compile.runner.ModelRunner`: requests are
sorted by length and handed to it in batches, which it packs into bucketed steps (continuous
batching), so a compiled step compiles nothing after its warm-up.
"""

from __future__ import annotations

import json
import logging

import jinja2

# lm-eval fills its model registry with its own models only while it is empty: make that happen
# before dsv4 is registered, or hf and the others would not be found in this process.
import lm_eval.models  # noqa: F401
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from .evaluate.inputs import InputError, check_device
from .evaluate.run import runner_on
from .model import enable

# (request key or None, context tokens, continuation tokens): what TemplateLM hands _loglikelihood_tokens
TokenRequest = tuple[tuple[str, str] | None, list[int], list[int]]
MAX_GEN_TOKS = 256  # max_gen_toks when a task does not set it (lm-eval's hf model: the same)
DEFAULT_BATCH_SIZE = 8  # also what batch_size=auto (lm-eval's search for the largest that fits) gives
TOP_K = 50  # transformers' top_k when neither gen_kwargs nor the model's generation config sets one
log = logging.getLogger(__name__)


@register_model("dsv4")
class DSV4LM(TemplateLM):
    """``lm-eval`` model over :func:`~dsv4_compile.model.enable` and one ``ModelRunner``.

    ``model_args``: ``pretrained`` (a checkpoint directory: ``from_pretrained(dtype=bfloat16)`` and
    its tokenizer), ``max_seq_len`` (the cache's tokens per request, a multiple of 256),
    ``batch_size`` (concurrent requests: the cache's request rows, and the number of
    log-likelihood requests scored per runner call; ``auto``: :data:`DEFAULT_BATCH_SIZE`),
    ``device`` (default CUDA when present),
    ``compile`` (run the step compiled as ``python -m dsv4_compile`` compiles it,
    :func:`~dsv4_compile.evaluate.run.compiled_step`, warmed up once),
    ``max_step_tokens`` (the runner's rows per step), ``max_length`` (the context lm-eval works
    with — rolling windows, truncation — at most, and by default, ``max_seq_len``),
    ``add_bos_token`` and ``prefix_token_id`` (as lm-eval's hf model: whether encoding adds the
    tokenizer's special tokens, and what a request without context conditions on)."""

    def __init__(self, pretrained: str, max_seq_len: int = 4096, batch_size: int | str = DEFAULT_BATCH_SIZE,
                 device: str | None = None, compile: bool | str = False, max_step_tokens: int = 256,
                 max_length: int | None = None, add_bos_token: bool | str | None = None,
                 prefix_token_id: int | str | None = None):
        super().__init__()
        self.add_bos_token = None if add_bos_token is None else _flag("add_bos_token", add_bos_token)
        self.custom_prefix_token_id = None if prefix_token_id is None else \
            _integer("prefix_token_id", prefix_token_id, least=0, what="a token id")
        try:
            self._device = check_device(device, what="device")
        except InputError as e:
            raise ValueError(str(e)) from None
        if isinstance(batch_size, str) and batch_size.startswith("auto"):
            batch_size = DEFAULT_BATCH_SIZE  # no memory search: the rows are the cache's, sized up front
        self.batch_size, max_seq_len = _count("batch_size", batch_size), _count("max_seq_len", max_seq_len)
        self.max_length = max_seq_len if max_length is None else _count("max_length", max_length)
        if self.max_length > max_seq_len:
            raise ValueError(f"max_length={self.max_length} exceeds max_seq_len={max_seq_len}")
        bos = {} if self.add_bos_token is None else {"add_bos_token": self.add_bos_token}
        self.tokenizer = AutoTokenizer.from_pretrained(pretrained, **bos)  # as the hf model loads it
        model = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.bfloat16).to(self._device)
        backend = enable(model, max_requests=self.batch_size, max_seq_len=max_seq_len)
        compiled = _flag("compile", compile)
        max_step_tokens = _count("max_step_tokens", max_step_tokens)
        self.runner, _ = runner_on(backend, compiled=compiled, max_step_tokens=max_step_tokens)
        if compiled:
            self.runner.warmup()

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "DSV4LM":
        """The model of ``model_args`` (``arg_dict``); lm-eval's own ``batch_size`` and ``device``
        (``additional_config``) fill in what ``model_args`` leaves out. Its command line always passes
        a ``batch_size`` (default 1), so one in ``model_args`` takes precedence rather than clash."""
        extra = {k: v for k, v in (additional_config or {}).items()
                 if k in ("batch_size", "device") and v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "DSV4LM":
        """As :meth:`create_from_arg_obj`, from ``key=value,...``."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # -- tokens ----------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What a request without context conditions on: ``prefix_token_id``, else BOS, else EOS (as
        lm-eval's hf model)."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else bos

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Token ids of ``string``; the tokenizer's special tokens (``add_bos_token`` when given)
        unless ``string`` already starts with the prefix token's text (as lm-eval's hf model)."""
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            add_special_tokens = False
        elif add_special_tokens is None:
            add_special_tokens = self.add_bos_token
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer.encode(string, **options)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    @property
    def tokenizer_name(self) -> str:
        """Keys lm-eval's request cache under a chat template (as its hf model names it)."""
        return self.tokenizer.name_or_path.replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The tokenizer's chat template applied to ``chat_history``, as text (lm-eval's
        ``--apply_chat_template``). A template that refuses the history (one without a system role,
        say) gets it again without system messages, as lm-eval's hf model retries."""
        def render(history):
            return self.tokenizer.apply_chat_template(history, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=not add_generation_prompt)
        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            log.warning("the chat template refused the history; rendering it without its system messages")
            return render([m for m in chat_history if m["role"] != "system"])

    # -- requests --------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list[TokenRequest], disable_tqdm: bool = False
                              ) -> list[tuple[float, bool]]:
        """``(sum of the continuation's log-probs, whether greedy decoding gives it)`` per request.
        The input is context + continuation without its last token, left-truncated to
        ``max_length`` tokens; the last ``len(continuation)`` positions are scored."""
        inputs = []
        for _, context, continuation in requests:
            if not context or not 0 < len(continuation) <= self.max_length:
                raise ValueError(f"a request needs context and 1 to max_length={self.max_length} continuation "
                                 f"tokens, got {len(context)} and {len(continuation)}")
            inputs.append((context + continuation)[-(self.max_length + 1):-1])
        order = sorted(range(len(requests)), key=lambda i: -len(inputs[i]))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        with tqdm(total=len(requests), disable=disable_tqdm, desc="dsv4 loglikelihood") as bar:
            for start in range(0, len(order), self.batch_size):
                batch = order[start:start + self.batch_size]
                scored = [len(requests[i][2]) for i in batch]  # the steps compute the continuation's logits only
                for i, logits in zip(batch, self.runner.logits([inputs[i] for i in batch], last=scored)):
                    key, _, continuation = requests[i]
                    results[i] = _continuation_score(logits, continuation)
                    if key is not None:
                        self.cache_hook.add_partial("loglikelihood", key, results[i])
                bar.update(len(batch))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole document, conditioned on the prefix token, in disjoint
        windows of at most ``max_length`` scored tokens each with the longest context that fits
        (lm-eval's rolling windows, as its hf model builds them)."""
        windows, owner = [], []
        for index, (string,) in enumerate(request.args for request in requests):
            pairs = get_rolling_token_windows(token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                                              max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(make_disjoint_window, pairs):
                windows.append((None, context, continuation))
                owner.append(index)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[index] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continuations of each context: greedy or sampled per the request's ``gen_kwargs``
        (``temperature``, ``top_p``, ``top_k``; what the model's generation config sets, else
        ``transformers``' defaults, where they are silent, as lm-eval's hf model samples), ending at
        an EOS id of the tokenizer or the generation config, when the continuation decoded with its
        special tokens contains a stop string (``until``, plus EOS), or after ``max_gen_toks``
        tokens, cut before the first stop string. Requests with the same ``gen_kwargs`` go to the
        runner together, longest context first."""
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
        results = [""] * len(requests)
        with tqdm(total=len(requests), disable=disable_tqdm, desc="dsv4 generate_until") as bar:
            for indices in groups.values():
                texts = self._generate([requests[i].args[0] for i in indices], requests[indices[0]].args[1])
                for i, text in zip(indices, texts):
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(indices))
        return results

    def _generate(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
        """The continuations of ``contexts`` under one ``gen_kwargs`` (see :meth:`generate_until`);
        each context is left-truncated so that it and ``max_gen_toks`` tokens fit in ``max_length``."""
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, MAX_GEN_TOKS))
        until = [s for s in handle_stop_sequences(kwargs.pop("until"), self.tokenizer.eos_token) if s]
        max_gen_toks = kwargs.pop("max_gen_toks")
        # where gen_kwargs are silent, what transformers' generate (lm-eval's hf model) samples with
        defaults = self.runner.backend.model.generation_config
        temperature = float(kwargs.pop("temperature", 0.0))
        top_p = float(kwargs.pop("top_p", 1.0 if defaults.top_p is None else defaults.top_p))
        top_k = int(kwargs.pop("top_k", TOP_K if defaults.top_k is None else defaults.top_k))
        if not kwargs.pop("do_sample"):
            temperature = 0.0
        if kwargs:
            raise ValueError(f"gen_kwargs: dsv4 takes until, max_gen_toks, do_sample, temperature, top_p and "
                             f"top_k, not {sorted(kwargs)}")
        if not 0 < max_gen_toks < self.max_length:
            raise ValueError(f"max_gen_toks={max_gen_toks} must lie in [1, max_length={self.max_length})")
        prompts = [self.tok_encode(c)[-(self.max_length - max_gen_toks):] or [self.prefix_token_id] for c in contexts]
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))

        def stop(_: int, tokens: list[int]) -> bool:  # special tokens kept: a stop string may be one
            text = self.tokenizer.decode(tokens, skip_special_tokens=False)
            return any(s in text for s in until)

        stop_ids = {self.eot_token_id, *_ids(defaults.eos_token_id)} - {None}
        seed = int(torch.randint(2**31 - 1, ()))  # lm-eval seeds torch: a run's draws are reproducible
        tokens = self.runner.generate([prompts[i] for i in order], max_gen_toks, temperature=temperature,
                                      top_p=top_p, top_k=top_k, stop_ids=stop_ids, seed=seed, stop=stop)
        texts = [""] * len(prompts)
        for k, i in enumerate(order):
            texts[i] = postprocess_generated_text(self.tok_decode(tokens[k]), until, None)
        return texts


def _ids(value: int | list[int] | None) -> list[int]:
    """A generation config's ``eos_token_id`` (one id, several or none) as a list."""
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def _continuation_score(logits: torch.Tensor, continuation: list[int]) -> tuple[float, bool]:
    """``(sum of log p(continuation), whether each token is the argmax)`` from the logits
    ``[len(continuation), vocab]`` of the positions that predict it."""
    logp = logits.float().log_softmax(-1)
    target = torch.tensor(continuation, device=logp.device)
    return float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())


def _count(name: str, value: int | str) -> int:
    """A positive integer model argument (see :func:`_integer`)."""
    return _integer(name, value, least=1, what="a positive integer")


def _integer(name: str, value: int | str, *, least: int, what: str) -> int:
    """An integer model argument of at least ``least`` (lm-eval may pass it as a string); a bool or
    a fraction is refused rather than rounded, the error calling it ``what`` it must be."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {what}, got {value!r}") from None
    if number < least or isinstance(value, bool) or (isinstance(value, float) and value != number):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return number


def _flag(name: str, value: bool | str) -> bool:
    """A boolean model argument: True / False or the strings true / false."""
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "false"):
        return str(value).lower() == "true"
    raise ValueError(f"{name} must be true or false, got {value!r}")


def main() -> None:
    """lm-eval's command line with the ``dsv4`` model registered (same arguments as ``lm_eval``)."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
