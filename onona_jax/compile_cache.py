"""JAX's persistent compilation cache (train.compile_cache, eval.py --compile_cache): a
restart loads its compiled step instead of compiling it again (docs/training.md, "Compilation cache")."""

import os

import jax

from onona_jax import cli, paths

# Set by the test suite (tests/conftest.py: a temporary directory) so that tests never fill the
# user's cache.
ENV = "ONONA_COMPILE_CACHE"


def default_dir() -> str:
    """`train.compile_cache`'s default: $ONONA_COMPILE_CACHE if set (may be "": off), else
    $XDG_CACHE_HOME/onona_jax/jax_cache, else ~/.cache/onona_jax/jax_cache."""
    if ENV in os.environ:
        return os.environ[ENV]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "onona_jax", "jax_cache")


_hits = [0]
_listening = False


def _count_hit(event: str, **_):
    if event == "/jax/compilation_cache/cache_hits":
        _hits[0] += 1


def hits() -> int:
    """Persistent-cache hits in this process since `use` first turned it on."""
    return _hits[0]


def use(directory: str, min_compile_s: float = 1.0, key: str = "train.compile_cache") -> str:
    """Point JAX's persistent compilation cache at `directory` (local or a bucket URL; "" turns
    it off) before anything compiles, caching only programs that took at least `min_compile_s`
    to compile (the train and eval steps, not the many small ones). The directory is created
    and written to now, so an unwritable one is one error line (ValueError naming `key`)
    before any compile. Returns the directory used ("" when off)."""
    global _listening
    from jax.experimental.compilation_cache import compilation_cache

    directory = paths.absolute(os.path.expanduser(directory)) if directory else ""
    if directory:
        try:
            reason = cli.unwritable(directory)
        except Exception as err:  # noqa: BLE001 - a bucket's client raises its own
            reason = cli.reason(err)
        if reason:
            env = os.environ.get(ENV)
            if env and directory == paths.absolute(os.path.expanduser(env)):  # the default, from the environment
                raise ValueError(f"{ENV}={env} ({key}'s default): cannot write there ({reason}); set it to a "
                                 f"writable directory or bucket path, or to nothing ({ENV}=) to turn the "
                                 "compilation cache off")
            raise ValueError(f"{key}={directory}: cannot write there ({reason}); give a writable directory "
                             f"or bucket path, or {key}= (empty) to turn the compilation cache off")
        if not _listening:
            jax.monitoring.register_event_listener(_count_hit)
            _listening = True
    if (jax.config.jax_compilation_cache_dir or "") != directory:
        # JAX opens its cache once per process: a new directory (a second run in-process) needs a reset.
        compilation_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", directory or None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_s))
    return directory
