"""The fault battery: every failure users found (issues 12 and 24) as a table of cases, each
run as the real command on real files, and kill -9 at random moments over N cycles, checked
bit for bit against an uninterrupted run.

    python -m tests.battery                                  # every case; 3 kill cycles, local disk and GCS emulator
    python -m tests.battery --cycles=10 --stores=local,gcs --seed=1
    python -m tests.battery --groups=lock,storage --cycles=0
    python -m tests.battery --list                           # the table, nothing run
    python -m tests.battery --groups=storage --cycles=0 --load=8   # timed cases on a loaded machine

A case is (command, fault, expected exit, expected bytes on disk): the fault is set up before
the command or injected while it runs, and the case holds when the exit status, the one
`error:` line (no traceback), the time it took and the files on disk are as the row says. A kill
cycle trains a fresh workdir (12 steps, a checkpoint every 2, validation every 4) and kills it
1-3 times at a random moment of a random kind (during a step, a checkpoint save, a validation,
a SIGTERM, or the prepare of its data), reruns until it finishes, and holds when every logged
loss and the final validation equal the uninterrupted run's bit for bit, no lock and no
temporary checkpoint is left, and the data prepared after the kill equals a clean prepare's.
On `--stores=gcs` the workdir is a bucket on the local GCS emulator (tests/fake_gcs.py).

It prints one line per case and cycle, then `N cases tried, M held`, and exits 1 if any did not
hold. Cases that need what this machine does not allow (root for `mount`/`chattr`, `unshare`)
are reported as skipped, with the reason. `tests/battery/test_faults.py` (slow) runs it in CI.

Every subprocess shares a JAX compilation cache in the battery's temporary directory, so the
tiny model compiles once and each command costs little more than its imports.

Run it from the repository's root. The package, one module a concern: harness.py (what every
case shares and the table they register in), lock.py, inputs.py (bad values, resumes, mixtures),
checkpoints.py, storage.py, prepare.py, commands.py (export, import, the other commands' inputs),
interrupt.py (SIGINT), cycles.py (the kill -9 cycles) and __main__.py (the command).
"""
