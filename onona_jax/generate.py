"""Generate text from a trained checkpoint.

    python -m onona_jax.generate --workdir=runs/dense-small-twin --prompt="It is a truth" \\
        [--max_new_tokens=64] [--greedy | --temperature=0.8 --top_k=50 --top_p=0.95] \\
        [--one_projection] [--seed=0] [--step=N] [--stop_at_eot]

Prints the continuation, then a line of timings: tokens/s of the decode loop (compile time
excluded and reported separately). `--one_projection` samples exactly at temperature 1 with
one V×d projection per token (twin heads; see serving.py). An empty prompt starts a document
(end-of-text token).
"""

from __future__ import annotations

import sys

from absl import app, flags

from onona_jax import platform

platform.initialize()

flags.DEFINE_string("workdir", None, "run directory with checkpoints/", required=True)
flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)")
flags.DEFINE_string("prompt", "", "text to continue (empty: start a new document)")
flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate")
flags.DEFINE_bool("greedy", False, "argmax of the mixture log-probabilities")
flags.DEFINE_float("temperature", 1.0, "sampling temperature (acts on the mixture)")
flags.DEFINE_integer("top_k", 0, "keep the k most probable tokens (0: off)")
flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass (1.0: off)")
flags.DEFINE_bool("one_projection", False, "exact temperature-1 sampling with one projection (twin)")
flags.DEFINE_integer("seed", 0, "sampling seed")
flags.DEFINE_bool("stop_at_eot", True, "stop at the end-of-text token")
flags.DEFINE_integer("max_len", None, "prompt + generated tokens bound (default: the training context)")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    from absl import logging

    logging.set_verbosity(logging.ERROR)  # Orbax warns that a read-only manager won't save
    from onona_jax import tokenizer
    from onona_jax.serving import Server

    try:
        server = Server.from_workdir(FLAGS.workdir, FLAGS.step, max_len=FLAGS.max_len)
        prompt = tokenizer.encode(FLAGS.prompt) or [tokenizer.EOT]
        if len(prompt) + FLAGS.max_new_tokens > server.max_len:  # keep the end of a long prompt
            prompt = prompt[-(server.max_len - FLAGS.max_new_tokens):]
        [tokens] = server.generate(
            [prompt], FLAGS.max_new_tokens, greedy=FLAGS.greedy, temperature=FLAGS.temperature,
            top_k=FLAGS.top_k, top_p=FLAGS.top_p, one_projection=FLAGS.one_projection,
            seed=FLAGS.seed, stop_tokens=(tokenizer.EOT,) if FLAGS.stop_at_eot else (),
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    # Table rows past the tokenizer's 50,257 entries (padding) have no text.
    text = tokenizer.decode([t for t in tokens if t < tokenizer.TOKENIZER_VOCAB])
    print(text)
    s = server.last_stats
    mode = ("greedy" if FLAGS.greedy else "one-projection sampling" if FLAGS.one_projection else "sampling")
    print(
        f"[{mode}, step {server.step}] {len(tokens)} new tokens ({s['steps']} steps), "
        f"prefill {len(prompt)} tokens in {s['prefill_s']:.3f} s, decode {s['decode_s']:.3f} s: "
        f"{s['tokens_per_s']:.1f} tokens/s overall, {s['decode_tokens_per_s']:.1f} tokens/s decoding "
        f"(compile {s.get('compile_s', 0.0):.1f} s, not counted)"
    )


if __name__ == "__main__":
    app.run(main)
