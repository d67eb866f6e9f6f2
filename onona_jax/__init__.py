"""onóna in JAX: twin embeddings with tied unembeddings (arXiv 2611.10556)."""

__version__ = "0.1.0"

# A Ctrl-C before a command's own work begins (imports, jax.distributed): one line, the same for both.
INTERRUPTED_WHILE_STARTING = "interrupted while starting; nothing was written"


def _interrupted_while_starting(signum, frame):
    import os

    os.write(2, f"error: {INTERRUPTED_WHILE_STARTING}\n".encode())
    os._exit(130)


def _catch_interrupts_while_starting():
    """A command started from the shell (train.py, eval.py, `python -m onona_jax...`) spends
    seconds importing JAX before `cli.run` takes over SIGINT: a Ctrl-C then is one line and exit
    130, not an import's traceback (nothing has been written yet). Left alone where onona_jax is
    imported as a library (pytest, a notebook, `python -c`)."""
    import os
    import signal
    import sys
    import threading

    argv0 = sys.argv[0] if sys.argv else ""
    if ((argv0 == "-m" or os.path.basename(argv0) in ("train.py", "eval.py"))
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        signal.signal(signal.SIGINT, _interrupted_while_starting)


_catch_interrupts_while_starting()
