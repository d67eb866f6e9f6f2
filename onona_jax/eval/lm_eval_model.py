"""An lm-evaluation-harness model ("onona") over an onona-jax checkpoint, so that any harness
task runs on our models:

    import lm_eval, onona_jax.eval.lm_eval_model  # the import registers "onona"
    lm_eval.simple_evaluate(model="onona", model_args="workdir=runs/142m-twin,batch_size=8",
                            tasks=["lambada_openai"])

or from the shell, the harness's own CLI with "onona" registered:

    python -m onona_jax.eval.lm_eval_model run --model onona --model_args workdir=DIR --tasks lambada_openai

model_args: workdir (required unless a Scorer is passed in Python), step (default latest),
batch_size (8), max_length (1024: the context, in tokens, of every scored request),
max_gen_toks (256), mesh ("DATAxFSDPxTENSOR", default "-1x1x1"; commas would split
model_args).

- `loglikelihood` is the harness's `TemplateLM.loglikelihood` (its context/continuation
  tokenisation) over `tasks.Scorer.loglikelihood_tokens` (left truncation to max_length,
  log p summed over the continuation, greedy check), the scoring our own tasks use;
- `loglikelihood_rolling` scores each string in the harness's disjoint rolling windows
  (`tasks.rolling_windows`, context_len 1, the eot as prefix), summed;
- `generate_until` decodes with `serving.Server.generate` (greedy unless the request asks
  do_sample, or gives a temperature > 0 alone; then temperature, top_p and top_k are passed
  on, seed 0), stopping at the eot, then cuts the text at the first of the `until` strings, as
  the harness's HF model does; the prompt is left-truncated to max_length - max_gen_toks
  tokens (an empty prompt becomes the eot).

Text is tokenised with the run's tokenizer (the Scorer's: `tokenizer.from_config` of the
checkpoint's data group); the eot is its end-of-document token, `tokenizer_name` its name.

Harness tasks read their data through Hugging Face `datasets`; offline, give them local
files with a task YAML (`dataset_path: json`, `dataset_kwargs: {data_files: ...}`) found by
`TaskManager(include_path=DIR)`; `tests/fixtures/lm_eval_tasks/` has such YAMLs.
"""

from __future__ import annotations

import sys

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from onona_jax.eval.tasks.scoring import Scorer, rolling_windows


def _parse_mesh(mesh) -> tuple[int, int, int]:
    if isinstance(mesh, (tuple, list)):
        parts = list(mesh)
    else:
        parts = str(mesh).replace(":", "x").split("x")
    if len(parts) != 3:
        raise ValueError(f"mesh={mesh!r}: give data x fsdp x tensor sizes, e.g. 8x1x1 or -1x1x1")
    return tuple(int(p) for p in parts)


@register_model("onona")
class OnonaLM(TemplateLM):
    """lm-evaluation-harness LM over an onona-jax checkpoint (see the module docstring)."""

    def __init__(self, workdir: str | None = None, step: int | None = None, batch_size=8,
                 max_length: int = 1024, max_gen_toks: int = 256, mesh="-1x1x1",
                 scorer: Scorer | None = None, server=None, progress: bool = False, **kwargs):
        super().__init__()
        # simple_evaluate passes batch_size / max_batch_size / device; only batch_size is used.
        kwargs.pop("device", None)
        kwargs.pop("max_batch_size", None)
        if kwargs:
            raise TypeError(f"onona: unknown model_args {sorted(kwargs)}")
        if batch_size in (None, "auto") or str(batch_size).startswith("auto"):
            batch_size = 8
        if scorer is None:
            if workdir is None:
                raise ValueError("onona: model_args needs workdir=DIR (a run directory with checkpoints/)")
            scorer = Scorer.from_workdir(workdir, None if step in (None, "") else int(step),
                                         mesh=_parse_mesh(mesh), batch_size=int(batch_size),
                                         max_length=int(max_length), progress=progress)
        self.scorer = scorer
        self.workdir = workdir
        self._server = server
        self._max_gen_toks = int(max_gen_toks)

    # ------------------------------------------------------------------ tokenizer

    @property
    def run_tokenizer(self):
        """The run's tokenizer (`onona_jax.tokenizer.Tokenizer`), the scorer's. (Not
        `tokenizer`: the harness reads that as a HF tokenizer's chat template, which we lack.)"""
        return self.scorer.tokenizer

    @property
    def eot_token_id(self) -> int:
        return self.run_tokenizer.eot

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self.scorer.batch_size

    @property
    def tokenizer_name(self) -> str:
        return self.run_tokenizer.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.run_tokenizer.encode(string)

    def tok_decode(self, tokens, **kwargs) -> str:
        return self.run_tokenizer.decode(tokens)

    # ------------------------------------------------------------------ scoring

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = self.scorer.loglikelihood_tokens([(ctx, cont) for _, ctx, cont in requests])
        for (pair, _, _), res in zip(requests, results):
            if pair is not None:
                self.cache_hook.add_partial("loglikelihood", pair, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for w in rolling_windows(self.tok_encode(string), self.max_length, self.prefix_token_id):
                windows.append(w)
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, self.scorer.loglikelihood_tokens(windows)):
            totals[i] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    # ------------------------------------------------------------------ generation

    @property
    def server(self):
        if self._server is None:
            from onona_jax.serve.server import Server

            if self.workdir is not None:  # one device, as serving does
                self._server = Server.from_workdir(self.workdir, self.scorer.step, max_len=self.max_length)
            elif getattr(self.scorer, "cfg", None) is not None:
                self._server = Server(self.scorer.cfg, self.scorer.params, max_len=self.max_length)
            else:
                raise ValueError("onona: generate_until needs workdir=DIR, a Scorer with a config, or server=")
        return self._server

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode([self.eot_token_id])
        groups: dict = {}  # requests with equal generation settings decode together
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            kw = dict(gen_kwargs or {})
            until = kw.pop("until", None)
            until = [until] if isinstance(until, str) else list(until or [])
            if eos not in until:
                until.append(eos)
            max_gen = next((int(kw.pop(k)) for k in ("max_gen_toks", "max_new_tokens", "max_tokens",
                                                     "max_completion_tokens") if kw.get(k) is not None),
                           self.max_gen_toks)
            do_sample, temperature = kw.pop("do_sample", None), kw.pop("temperature", None)
            if do_sample is None:  # as the harness: a positive temperature alone asks for sampling
                do_sample = temperature is not None and float(temperature) > 0.0
            temperature = 1.0 if temperature is None else float(temperature)
            do_sample = bool(do_sample) and temperature > 0.0  # temperature 0: greedy
            sampling = (float(kw.pop("top_p", 1.0) or 1.0), int(kw.pop("top_k", 0) or 0)) if do_sample else (1.0, 0)
            if max_gen >= self.max_length:
                raise ValueError(f"onona: max_gen_toks={max_gen} must be below max_length={self.max_length}")
            ids = self.tok_encode(context)[-(self.max_length - max_gen):] or [self.eot_token_id]
            key = (max_gen, do_sample, temperature if do_sample else 0.0, sampling)
            groups.setdefault(key, []).append((i, ids, until))
        out: list = [None] * len(requests)
        for (max_gen, do_sample, temperature, (top_p, top_k)), items in groups.items():
            kwargs = {"greedy": not do_sample, "stop_tokens": (self.eot_token_id,)}
            if do_sample:
                kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k)
            for s in range(0, len(items), self.batch_size):
                batch = items[s:s + self.batch_size]
                gens = self.server.generate([ids for _, ids, _ in batch], max_gen, **kwargs)
                for (i, ids, until), gen in zip(batch, gens):
                    gen = list(gen)
                    if self.eot_token_id in gen:
                        gen = gen[:gen.index(self.eot_token_id)]
                    text = self.tok_decode(gen)
                    for term in until:
                        if term:
                            text = text.split(term)[0]
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out


def main():
    """The harness CLI (`lm_eval ...`) with the "onona" model registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "lm_eval"
    cli_evaluate()


if __name__ == "__main__":
    main()
