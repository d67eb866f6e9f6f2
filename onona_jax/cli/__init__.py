"""One command-line convention for every entry point (train.py, eval.py and every
`python -m onona_jax.<module>`): absl flags, with ml-collections config flags where a
command takes a config (`--config=configs/paper.py:<spec> --config.train.lr=...`, as
big_vision and MaxText do; `config.define_flag`), and one `error: <problem and fix>` line
for each anticipated failure, never a traceback.

An entry point defines its flags in a function (returning `config.define_flag`'s explainer
of bad config overrides, if it takes a config) and runs its body through `run`, which
builds a fresh `FlagValues` per call, so several entry points can be imported into one
process and their `main(argv)` called in-process (the tests do):

    def define(fv, argv):
        flags.DEFINE_string("workdir", None, "run directory", flag_values=fv)

    def _main(fv, args):          # args: the positional arguments
        ...

    def main(argv=None) -> int:
        return cli.run(define, _main, argv, __doc__)

`--help` (-h, --helpfull) prints the flags without parsing the rest (a required flag may be
missing) and without importing jax, which is slow to start: an entry point imports
jax, and what imports it (config, models, heads), inside its functions, and its `define` gives
the config flag by `define_config_for_help` when `help_asked(argv)` (tests/integration/test_startup.py).

Exit status: 0 done; 2 bad usage or bad input found before any write (an unknown flag or
config key, a bad value: `ValueError`); 1 an anticipated runtime failure (`Failure`); 130
interrupted (SIGINT, Ctrl-C: `Interrupted`).

The pieces: `command` (flags, --help, `run`, `run_module`), `signals` (SIGINT while a command
runs: the first stops it cleanly, the second exits at once; `exit_process`), `preflight` (what
is checked before the work: writable outputs, environment variables, accelerators) and `errors`
(`Failure`, `UsageError`). Every name a command uses is here, as `cli.<name>`.
"""

from onona_jax.cli.command import (HELP, define_config_for_help, define_mesh, flag_value, help_asked, mesh, run,
                                   run_module)
from onona_jax.cli.errors import Failure, UsageError
from onona_jax.cli.preflight import (EXTRAS, accelerators, check_environment, check_output_dir, check_output_file,
                                     environment_failure, quiet_libtpu, reason, seconds_from_env, unwritable)
from onona_jax.cli.signals import (AT_ONCE, INTERRUPTED, GracefulStop, Interrupted, exit_process, graceful_stop,
                                   interrupted)

__all__ = [
    "AT_ONCE", "EXTRAS", "HELP", "INTERRUPTED", "Failure", "GracefulStop", "Interrupted", "UsageError",
    "accelerators", "check_environment", "check_output_dir", "check_output_file", "define_config_for_help",
    "define_mesh", "environment_failure", "exit_process", "flag_value", "graceful_stop", "help_asked",
    "interrupted", "mesh", "quiet_libtpu", "reason", "run", "run_module", "seconds_from_env", "unwritable",
]

