"""Generate text from a trained checkpoint.

    python -m onona_jax.serve.generate --workdir=runs/dense-small-twin --prompt="It is a truth" \\
        [--max_new_tokens=64] [--greedy | --temperature=0.8 --top_k=50 --top_p=0.95] \\
        [--one_projection] [--seed=0] [--step=N] [--stop_at_eot]

Prints the continuation, then a line of timings: tokens/s of the decode loop (compile time
excluded and reported separately). `--one_projection` samples exactly at temperature 1 with
one V×d projection per token (twin heads; see serve/server.py). An empty prompt starts a document
(the end-of-document token). Text is encoded and decoded with the run's tokenizer
(data.tokenizer of the checkpoint's config), whose end-of-document token `--stop_at_eot` stops at.
"""

from __future__ import annotations

import sys

from absl import flags

from onona_jax import cli


def define(fv, argv):
    flags.DEFINE_string("workdir", None, "run directory with checkpoints/", flag_values=fv, required=True)
    flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)", flag_values=fv)
    flags.DEFINE_string("prompt", "", "text to continue (empty: start a new document)", flag_values=fv)
    flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate", flag_values=fv)
    flags.DEFINE_bool("greedy", False, "argmax of the mixture log-probabilities", flag_values=fv)
    flags.DEFINE_float("temperature", 1.0, "sampling temperature (acts on the mixture)", flag_values=fv)
    flags.DEFINE_integer("top_k", 0, "keep the k most probable tokens (0: off)", flag_values=fv)
    flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass (1.0: off)", flag_values=fv)
    flags.DEFINE_bool("one_projection", False, "exact temperature-1 sampling with one projection (twin)", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "sampling seed", flag_values=fv)
    flags.DEFINE_bool("stop_at_eot", True, "stop at the end-of-text token", flag_values=fv)
    flags.DEFINE_integer("max_len", None, "prompt + generated tokens bound (default: the training context)", flag_values=fv)


def fit_prompt(prompt: list, max_len: int, max_new_tokens: int) -> tuple[list, int]:
    """The prompt's END (what the continuation follows) in the room the context leaves, and
    how many tokens were dropped from its start."""
    room = max_len - max_new_tokens
    if room < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in {max_len} tokens")
    dropped = max(0, len(prompt) - room)
    return prompt[dropped:], dropped


def _main(fv, args):
    if args:
        raise cli.UsageError(f"unexpected arguments {args}")
    from onona_jax.serve.server import Server

    if fv.max_new_tokens < 1:
        raise cli.UsageError(f"--max_new_tokens={fv.max_new_tokens}: give at least 1 token to generate")
    if fv.max_len is not None and fv.max_len <= fv.max_new_tokens:
        raise cli.UsageError(f"--max_len={fv.max_len} leaves no room for a prompt before "
                             f"--max_new_tokens={fv.max_new_tokens}; raise --max_len or lower --max_new_tokens")
    server = Server.from_workdir(fv.workdir, fv.step, max_len=fv.max_len)
    if server.max_len <= fv.max_new_tokens:
        raise cli.UsageError(f"--max_new_tokens={fv.max_new_tokens} fills the whole context ({server.max_len} "
                             "tokens) with no room for the prompt; lower it or raise --max_len")
    tok = server.tokenizer
    prompt, dropped = fit_prompt(tok.encode(fv.prompt) or [tok.eot], server.max_len, fv.max_new_tokens)
    if dropped:
        print(f"notice: the prompt is longer than the context allows ({server.max_len} tokens, "
              f"{fv.max_new_tokens} of them to generate): its first {dropped} tokens were dropped, "
              "the end is kept", file=sys.stderr)
    [tokens] = server.generate(
        [prompt], fv.max_new_tokens, greedy=fv.greedy, temperature=fv.temperature,
        top_k=fv.top_k, top_p=fv.top_p, one_projection=fv.one_projection,
        seed=fv.seed, stop_tokens=(tok.eot,) if fv.stop_at_eot else (),
    )
    text = tok.decode(tokens)  # table rows past the tokenizer's entries (padding) have no text: dropped
    print(text)
    s = server.last_stats
    mode = ("greedy" if fv.greedy else "one-projection sampling" if fv.one_projection else "sampling")
    print(
        f"[{mode}, step {server.step}] {len(tokens)} new tokens ({s['steps']} steps), "
        f"prefill {len(prompt)} tokens in {s['prefill_s']:.3f} s, decode {s['decode_s']:.3f} s: "
        f"{s['tokens_per_s']:.1f} tokens/s overall, {s['decode_tokens_per_s']:.1f} tokens/s decoding "
        f"(compile {s.get('compile_s', 0.0):.1f} s, not counted)"
    )


def main(argv=None) -> int:
    return cli.run(define, _main, argv, __doc__)


if __name__ == "__main__":
    cli.run_module(define, _main, __doc__)
