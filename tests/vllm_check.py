"""Run inside the vLLM venv (scripts/vllm_env.sh) by tests/integration/test_vllm_e2e.py:

    python tests/vllm_check.py EXPORT JOB.json OUT.json [EXPORT JOB.json OUT.json ...]

JOB: {"greedy": [prompts], "greedy_tokens": n, "logprob_prompts": [prompts], "logprobs": k,
      "draw_prompts": [prompts], "draws": per prompt, "n": draws per request}  (no draw_prompts:
      greedy and prompt logprobs only; {"refused_start": true}: the error starting the engine;
      "tensor_parallel_size": N: that many vLLM workers, each on its own cores)
OUT: {"architecture", "greedy": [tokens], "prompt_logprobs": [[{token: logprob}, ...]],
      "mixture_draws": [[token, ...] per draw prompt], "one_projection_draws": [...],
      "refused": message, "no_check": message, "seconds": {...}} or {"start_error": message}

Two engines, one after the other in this process: the exact mixture (greedy, prompt
logprobs, temperature-1 draws), then one-projection mode (draws; a temperature-0.7 request
must be refused at admission); last, one-projection without its request check must refuse
to start. Token ids in and out (skip_tokenizer_init); fp32; eager; in-process engine.
"""

import json
import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine: seconds, not tens, to start
CHECK = "onona_jax.serve.vllm:OneProjectionRequests"


def engine(folder, tensor_parallel_size=1, **kw):
    from vllm import LLM

    if tensor_parallel_size > 1:  # the workers in processes of their own, each bound to its share of the cores
        cores = sorted(os.sched_getaffinity(0))
        per = max(1, len(cores) // tensor_parallel_size)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            ",".join(map(str, cores[r * per:(r + 1) * per] or cores[-1:])) for r in range(tensor_parallel_size))
        kw.update(tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="mp")
    return LLM(folder, dtype="float32", skip_tokenizer_init=True, enforce_eager=True, seed=0,
               kv_cache_memory_bytes=256 << 20, max_model_len=256, max_num_seqs=256,
               max_num_batched_tokens=4096, **kw)


def draws(llm, prompts, per_prompt, n):
    from vllm import SamplingParams

    sp = SamplingParams(n=n, max_tokens=1, temperature=1.0, detokenize=False)
    requests = [{"prompt_token_ids": p} for p in prompts for _ in range(per_prompt // n)]
    out = llm.generate(requests, sp, use_tqdm=False)
    per = [[] for _ in prompts]
    for i, r in enumerate(out):
        per[i // (per_prompt // n)].extend(c.token_ids[0] for c in r.outputs)
    return per


def main(folder, job_file, out_file):
    from vllm import SamplingParams

    job = json.load(open(job_file))
    result, seconds = {}, {}
    t = time.perf_counter()
    if job.get("refused_start"):  # an export the plugin must refuse: the error it gives
        try:
            engine(folder)
            result["start_error"] = None
        except Exception as err:
            result["start_error"] = f"{type(err).__name__}: {err}"
        with open(out_file, "w") as f:
            json.dump(result, f)
        return
    llm = engine(folder, job.get("tensor_parallel_size", 1))
    result["architecture"] = llm.llm_engine.model_config.architecture
    result["tensor_parallel_size"] = llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
    seconds["start"] = time.perf_counter() - t

    t = time.perf_counter()
    sp = SamplingParams(max_tokens=job["greedy_tokens"], temperature=0.0, detokenize=False, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p} for p in job["greedy"]], sp, use_tqdm=False)
    result["greedy"] = [list(r.outputs[0].token_ids) for r in out]
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, prompt_logprobs=job["logprobs"])
    out = llm.generate([{"prompt_token_ids": p} for p in job["logprob_prompts"]], sp, use_tqdm=False)
    result["prompt_logprobs"] = [[{int(k): v.logprob for k, v in d.items()} for d in r.prompt_logprobs[1:]]
                                 for r in out]
    seconds["greedy_and_logprobs"] = time.perf_counter() - t

    result["seconds"] = seconds
    if not job.get("draw_prompts"):  # greedy and logprobs only
        with open(out_file, "w") as f:
            json.dump(result, f)
        return
    t = time.perf_counter()
    result["mixture_draws"] = draws(llm, job["draw_prompts"], job["draws"], job["n"])
    seconds["mixture_draws"] = time.perf_counter() - t
    del llm

    t = time.perf_counter()
    llm = engine(folder, hf_overrides={"one_projection": True}, logits_processors=[CHECK])
    result["one_projection_draws"] = draws(llm, job["draw_prompts"], job["draws"], job["n"])
    seconds["one_projection_draws"] = time.perf_counter() - t
    try:
        llm.generate([{"prompt_token_ids": job["draw_prompts"][0]}],
                     SamplingParams(max_tokens=1, temperature=0.7, detokenize=False), use_tqdm=False)
        result["refused"] = None
    except Exception as err:  # vLLM's VLLMValidationError (a ValueError)
        result["refused"] = f"{type(err).__name__}: {err}"
    del llm

    try:  # one-projection mode without its request check: must not start
        engine(folder, hf_overrides={"one_projection": True})
        result["no_check"] = None
    except Exception as err:
        result["no_check"] = f"{type(err).__name__}: {err}"
    with open(out_file, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # (vLLM may start processes by spawn: keep the work under the guard)
    args = sys.argv[1:]
    for i in range(0, len(args), 3):  # one vLLM import for every export
        main(*args[i:i + 3])
    sys.stdout.flush()
    os._exit(0)  # skip the engines' slow teardown
