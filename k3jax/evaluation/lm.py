"""The lm-evaluation-harness model ``k3jax``: a checkpoint evaluated in this process, without HTTP.

Every request goes through the serving engine (``k3jax.serving.engine``): the same fixed-shape
prefill and decode programs, on the model's mesh, that ``infer.py --serve`` runs. Log-likelihoods
are scoring requests (``max_tokens=0``, the prompt's log-probabilities from the prefill: up to
``batch_size`` prompts per prefill, ``prefill_chunk`` tokens per call); generations are greedy
(or sampled, as the task asks) continuations decoded ``batch_size`` at a time with the task's stop
strings. Requests are sorted by length so a prefill batch pads little.

``lm_eval --model k3jax`` needs this module imported (lm-eval 0.4.13 has no plug-in discovery):
``python -m k3jax.evaluation ...`` is lm-eval's command line with it imported and the bundled tasks on
the include path; from Python, ``import k3jax.evaluation`` then ``lm_eval.simple_evaluate(model=
"k3jax", model_args={"checkpoint": ...})``, or pass a ``K3JaxLM(model=..., tokenizer=...)``.
"""

from __future__ import annotations

import queue

import lm_eval.models  # noqa: F401 (the harness's own models first: its registry loads them only while empty)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from k3jax.serving.engine import Engine
from k3jax.serving.request import SamplingParams, Sequence
from k3jax.serving.text import TextStream

DEFAULT_BATCH_SIZE = 8
DEFAULT_PREFILL_CHUNK = 256
DEFAULT_MAX_GEN_TOKS = 256
# Requests handed to the engine at once, per row: enough to keep its prefill batches full. Its queue
# holds twice that: a request counts as active there until its whole prefill batch is done.
IN_FLIGHT_PER_ROW = 4


@register_model("k3jax")
class K3JaxLM(TemplateLM):
    """``checkpoint``: a run, checkpoint or HF directory (``step``: which checkpoint; ``tokenizer``:
    another tokenizer spec; ``lora``: adapters to merge in, as ``infer.py --lora``); or, from Python,
    a ``model`` and its ``tokenizer`` objects. ``mesh``: the device mesh as for ``infer.py`` (axes
    separated by ``;`` inside ``--model_args``, whose fields are comma-separated). ``max_length``:
    tokens per request (default: the model's ``max_seq_len``; longer contexts lose their start).
    ``prefix_token``: the token an empty context or a rolling window starts from (default: the
    tokenizer's EOS, else BOS). ``device`` and ``max_batch_size`` are the harness's own arguments:
    JAX places the work, ``batch_size`` sizes it."""

    def __init__(self, checkpoint: str | None = None, *, model=None, tokenizer=None, step: int | None = None,
                 lora: str | None = None, mesh: str = "fsdp=-1", batch_size: int | str | None = None,
                 max_length: int | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
                 prefix_token: int | None = None, device: str | None = None, max_batch_size: int | None = None):
        super().__init__()
        if model is not None and lora is not None:
            raise ValueError("k3jax: lora= goes with checkpoint=; merge a model's adapters with model.merge_lora()")
        if (checkpoint is None) == (model is None):
            raise ValueError("k3jax: pass checkpoint=PATH (a run, checkpoint or HF directory) or, from Python, "
                             "model= and tokenizer=")
        device_mesh = None
        if checkpoint is not None:
            from k3jax.tokenizer import load_tokenizer
            from k3jax.serving.loading import load_checkpoint_tokenizer, load_model
            from k3jax.sharding import make_mesh, parse_mesh

            device_mesh = make_mesh(parse_mesh(str(mesh).replace(";", ",")))
            model, cfg = load_model(str(checkpoint), step=step, mesh=device_mesh if device_mesh.size > 1 else None,
                                    lora=lora)
            tokenizer = (load_tokenizer(str(tokenizer), source="tokenizer") if tokenizer is not None
                         else load_checkpoint_tokenizer(str(checkpoint), cfg))
        elif tokenizer is None:
            raise ValueError("k3jax: model= needs its tokenizer=")
        self.tokenizer = tokenizer
        self.batch_size = DEFAULT_BATCH_SIZE if batch_size in (None, "auto") else int(batch_size)
        self.max_length = int(max_length or model.cfg.max_seq_len)
        self.max_gen_toks = int(max_gen_toks)
        self._prefix_token = prefix_token
        self.engine = Engine(model, max_batch=self.batch_size, max_len=self.max_length, prefill_chunk=prefill_chunk,
                             prefill_batch=self.batch_size,
                             max_queue=2 * IN_FLIGHT_PER_ROW * self.batch_size, mesh=device_mesh)
        self._stop_ids = tuple(getattr(tokenizer, "stop_ids", ())) or (
            (tokenizer.eos_id,) if getattr(tokenizer, "eos_id", None) is not None else ())

    # --- tokens ------------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int | None:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        for token in (self._prefix_token, self.tokenizer.eos_id, self.tokenizer.bos_id):
            if token is not None:
                return int(token)
        raise ValueError(f"k3jax: {self.tokenizer!r} has no EOS or BOS token to start an empty context or a "
                         f"rolling window from; pass prefix_token=ID in --model_args")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return list(self.tokenizer.encode(string))

    def close(self) -> None:
        """Stop the engine's thread (it starts at the first request)."""
        self.engine.stop()

    # --- requests ----------------------------------------------------------------------------------------
    def _run(self, seqs: list[Sequence], finished: queue.Queue, desc: str, disable_tqdm: bool) -> None:
        """Submit ``seqs`` (longest first), ``IN_FLIGHT_PER_ROW`` per engine row at once, and wait for
        all of them; each one's ``on_finish`` puts into ``finished``."""
        self.engine.start()
        capacity = IN_FLIGHT_PER_ROW * self.engine.max_batch
        in_flight = 0
        with tqdm(total=len(seqs), desc=desc, disable=disable_tqdm) as bar:
            for seq in sorted(seqs, key=lambda s: -len(s.prompt)):
                while in_flight >= capacity:
                    finished.get()
                    in_flight -= 1
                    bar.update()
                self.engine.submit(seq)
                in_flight += 1
            for _ in range(in_flight):
                finished.get()
                bar.update()
        failed = [s for s in seqs if s.finish_reason not in ("stop", "length")]
        if failed:
            raise RuntimeError(f"k3jax: {len(failed)} request(s) failed in the engine ({failed[0].finish_reason}); "
                               f"see the log")

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether each continuation token is the most
        likely one) per (key, context ids, continuation ids); a sequence longer than ``max_length``
        loses the start of its context."""
        finished: queue.Queue = queue.Queue()
        jobs = []
        for _, context, continuation in requests:
            whole = (list(context) + list(continuation))[-self.max_length:]
            scored = min(len(continuation), len(whole) - 1)  # the first token has no log-probability
            seq = Sequence(whole, SamplingParams(max_tokens=0, logprobs=1, prompt_logprobs=True),
                           lambda token, logprobs: None, finished.put)
            jobs.append((seq, scored))
        self._run([seq for seq, _ in jobs], finished, "k3jax loglikelihood", disable_tqdm)
        out = []
        for seq, scored in jobs:
            entries = seq.prompt_logprobs[len(seq.prompt) - scored:]
            targets = seq.prompt[len(seq.prompt) - scored:]
            out.append((sum(e.logprob for e in entries), all(e.top_ids[0] == t for e, t in zip(entries, targets))))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text, scored in disjoint windows of up to ``max_length``
        tokens (the first starting from ``prefix_token_id``)."""
        windows, owners = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    self.tok_encode(text), self.prefix_token_id, self.max_length - 1, 1)):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation up to the first of its ``until`` strings (not included), its
        ``max_gen_toks`` or a stop token; greedy unless the task samples (``do_sample``)."""
        finished: queue.Queue = queue.Queue()
        jobs = []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(gen_kwargs)
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = min(int(kwargs.pop("max_gen_toks", self.max_gen_toks)), self.max_length - 1)
            sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 1.0 if sample else 0.0)) if sample else 0.0
            params = SamplingParams(max_tokens=max_new, temperature=temperature,
                                    top_p=float(kwargs.pop("top_p", 1.0)), seed=kwargs.pop("seed", None),
                                    stop_ids=self._stop_ids)
            prompt = self.tok_encode(context)[-(self.max_length - max_new):]
            text = TextStream(self.tokenizer, until)
            seq = Sequence(prompt, params, None, finished.put)
            seq.on_token = self._stop_at_strings(seq, text)
            jobs.append((seq, text))
        self._run([seq for seq, _ in jobs], finished, "k3jax generate_until", disable_tqdm)
        for _, text in jobs:
            text.finish()  # the text held back for a stop string that did not come
        return [text.emitted for _, text in jobs]

    def _stop_at_strings(self, seq: Sequence, text: TextStream):
        def on_token(token: int, logprobs) -> None:  # on the engine's thread
            text.add(token)
            if text.stopped:
                self.engine.cancel(seq, "stop")
        return on_token
