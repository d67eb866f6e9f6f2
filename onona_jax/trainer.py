"""Sharded training: one `jax.jit` step with explicit shardings, gradient accumulation,
periodic validation, Orbax checkpoints that resume exactly, and pre-emption handling.

`Run` gathers everything derived from the config (mesh, shardings, optimizer, step count)
and checks it against the devices *before* anything is compiled or written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from onona_jax import config as config_lib
from onona_jax import model as model_lib
from onona_jax import optim, sharding, summary
from onona_jax.checkpoint import Checkpoints
from onona_jax.params import init_params, logical_axes

# Peak dense bf16 TFLOP/s per device, for model FLOPs utilisation.
PEAK_TFLOPS = {
    "H100": 989.0, "H200": 989.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0,
    "TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5p": 459.0, "TPU v6 lite": 918.0,
}


def peak_tflops(cfg) -> float | None:
    if cfg.train.peak_tflops > 0:
        return float(cfg.train.peak_tflops)
    kind = jax.devices()[0].device_kind
    for name, tflops in PEAK_TFLOPS.items():
        if name.lower() in kind.lower():
            return tflops
    return None


def dense_standard_params(cfg) -> int:
    """Parameter count of the Dense Standard model of this size: the token budget's base."""
    m = ml_collections.ConfigDict(cfg.model.to_dict())
    m.arch, m.head = "dense", "standard"
    return summary.param_counts(m)["total"]


# ----------------------------------------------------------------------------- setup


@dataclasses.dataclass
class Run:
    cfg: ml_collections.ConfigDict
    mesh: jax.sharding.Mesh
    graphdef: object
    abstract_params: object
    param_shardings: object
    state_shardings: dict
    batch_sharding: NamedSharding
    tx: optax.GradientTransformation
    schedule: object
    steps: int
    accum: int
    eval_steps: dict = dataclasses.field(default_factory=dict)  # table -> jitted, compiled once

    @property
    def dp(self) -> int:
        return self.mesh.shape["data"] * self.mesh.shape["fsdp"]


def _check_divisible(logical, abstract, mesh):
    """Every sharded parameter dimension must divide evenly by its mesh axes."""
    for (path, spec), (_, var) in zip(
        flat_variables_of(logical), flat_variables_of(abstract)
    ):
        mesh_spec = sharding.logical_to_mesh(spec)
        for dim, (size, axes) in enumerate(zip(var.shape, mesh_spec)):
            if axes is None:
                continue
            n = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
            if size % n:
                raise ValueError(
                    f"parameter {path} dimension {dim} ({spec[dim]}) has size {size}, not divisible "
                    f"by mesh axis {axes} of size {n}; choose --config.mesh.* so that it divides "
                    f"(e.g. heads, kv_heads, d_ff and vocab_size divisible by mesh.tensor)"
                )


def flat_variables_of(tree):
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, P))[0]
    return [("/".join(str(getattr(k, "key", k)) for k in path), leaf) for path, leaf in leaves]


def setup(cfg, devices=None) -> Run:
    """Validate `cfg` against this run's devices and derive the mesh, shardings and optimizer.
    Raises ValueError before anything is compiled or written."""
    config_lib.validate(cfg)
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices)
    graphdef, state = model_lib.abstract(cfg.model)
    logical = logical_axes(state)
    abstract_params = jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(state)
    )
    _check_divisible(logical, abstract_params, mesh)

    t = cfg.train
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = t.micro_batch or max(1, t.global_batch // dp)
    if t.global_batch % (micro * dp):
        raise ValueError(
            f"train.global_batch={t.global_batch} is not divisible by train.micro_batch="
            f"{micro} × data-parallel size {dp} (mesh.data × mesh.fsdp); choose a global "
            f"batch that is a multiple of {micro * dp}"
        )
    if t.global_batch % jax.process_count():
        raise ValueError(
            f"train.global_batch={t.global_batch} is not divisible by {jax.process_count()} processes"
        )
    accum = t.global_batch // (micro * dp)

    steps = optim.total_steps(cfg, dense_standard_params(cfg))
    if steps <= 0:
        raise ValueError(f"train.steps resolves to {steps}; it must be positive")
    tx, schedule = optim.make_optimizer(cfg, steps, logical)

    param_shardings = sharding.named_shardings(logical, mesh)
    replicated = NamedSharding(mesh, P())
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    opt_shardings = optax.tree_map_params(
        tx, lambda _, s: s, abstract_opt, param_shardings,
        transform_non_params=lambda _: replicated,
    )
    state_shardings = {"params": param_shardings, "opt_state": opt_shardings, "step": replicated}
    batch_sharding = NamedSharding(mesh, P(("data", "fsdp"), None))
    return Run(cfg, mesh, graphdef, abstract_params, param_shardings, state_shardings,
               batch_sharding, tx, schedule, steps, accum)


def abstract_train_state(run: Run):
    """ShapeDtypeStructs with shardings: what Orbax restores into."""
    shapes = jax.eval_shape(lambda p: _new_state(run, p), run.abstract_params)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, run.state_shardings
    )


def _new_state(run: Run, params):
    return {"params": params, "opt_state": run.tx.init(params), "step": jnp.zeros((), jnp.int32)}


def init_state(run: Run, seed: int):
    """Parameters and optimizer state created directly sharded on the mesh."""
    _, abstract = model_lib.abstract(run.cfg.model)

    def make():
        return _new_state(run, init_params(abstract, seed))

    return jax.jit(make, out_shardings=run.state_shardings)()


def upcycle(run: Run, state, source: str):
    """Start a two-table model from a tied Standard checkpoint (SPEC §1, containment): A = B = E
    and the body copied; the gate keeps its fresh init, since while A = B every gate value
    gives the Standard model. `source` is the Standard run's workdir (its latest checkpoint)."""
    from onona_jax import evaluation

    mesh = tuple(run.mesh.shape[a] for a in sharding.MESH_AXES)
    _, src, step, src_cfg = evaluation.load_run(source, mesh=mesh, devices=list(run.mesh.devices.flat))
    params = state["params"]
    if src_cfg.model.head != "standard" or set(params["head"]) < {"A", "B"}:
        raise ValueError(
            f"init_from={source}: upcycling copies a standard checkpoint's table into A and B; "
            f"got a {src_cfg.model.head!r} checkpoint for a {run.cfg.model.head!r} model"
        )
    shapes = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)  # noqa: E731
    if shapes(src["trunk"]) != shapes(params["trunk"]):
        raise ValueError(
            f"init_from={source}: its body ({src_cfg.name}) differs from this model's "
            f"({run.cfg.name}) in structure or shapes; use the same arch, size and scan_layers"
        )
    E = src["head"]["embedding"]
    # B is a copy: the step donates its inputs, and one buffer donated twice is freed twice.
    head = {**params["head"], "A": E, "B": jnp.copy(E)}
    new = jax.device_put({"trunk": src["trunk"], "head": head}, run.param_shardings)
    print(f"upcycled from {source} (step {step}): A = B = E, body copied", file=sys.stderr)
    return {**state, "params": new}


# ----------------------------------------------------------------------------- steps


def loss_and_aux(graphdef, params, tokens, table: str | None = None, moe_coef: float = 0.0):
    """(objective, aux) of a [b, T+1] batch: the mean next-token NLL (`aux["lm_loss"]`) plus,
    for MoE, `moe_coef` × the load-balancing loss pooled over layers; aux also carries gate
    statistics (two-table heads) and router statistics (MoE)."""
    model = model_lib.bind(graphdef, params)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if table is not None:
        loss = -jnp.mean(model.target_log_probs(inputs, targets, table=table))
        return loss, {"lm_loss": loss}
    h, x0, stats = model.forward(inputs)
    # The mean as per-token weights 1/N: the fused loss computes its gradients in the forward pass.
    loss, _ = model.head.nll(h, x0, targets, jnp.full(targets.shape, 1.0 / targets.size, jnp.float32))
    aux = {"lm_loss": loss}
    if hasattr(model.head, "gate_probs"):
        g = model.head.gate_probs(inputs)
        aux.update(gate_mean=jnp.mean(g), gate_sq=jnp.mean(jnp.square(g)))
    if "moe_assign" in stats:
        from onona_jax import moe

        balance = moe.load_balancing_loss(stats, stats["moe_assign"].shape[-1])
        router = moe.router_stats(stats)
        aux.update(moe_aux_loss=balance, moe_drop_fraction=router["drop_fraction"],
                   moe_max_load=router["max_load"], moe_load=router["expert_load"])
        loss = loss + moe_coef * balance
    return loss, aux


def accumulated_grads(run: Run, params, batch):
    """(loss, aux, grads) of a global [G, T+1] batch, averaged over `run.accum` micro-batches
    scanned in sequence (one compiled body)."""
    A = run.accum
    coef = run.cfg.model.moe.aux_coef if run.cfg.model.arch == "moe" else 0.0
    grad_fn = jax.value_and_grad(lambda p, b: loss_and_aux(run.graphdef, p, b, moe_coef=coef), has_aux=True)
    G, T1 = batch.shape
    # Micro-batch a takes rows a, a+A, a+2A, ...: each device keeps its own rows, and the
    # grouping does not depend on the mesh.
    micro = batch.reshape(G // A, A, T1).swapaxes(0, 1)
    micro = sharding.constrain(micro, (None, "batch", None))
    if A == 1:
        (loss, aux), grads = grad_fn(params, micro[0])
        return loss, aux, grads

    def body(carry, mb):
        (loss, aux), grads = grad_fn(params, mb)
        return jax.tree.map(jnp.add, carry, (loss, aux, grads)), None

    shapes = jax.eval_shape(grad_fn, params, micro[0])
    (loss, aux), grads = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    grads = jax.lax.with_sharding_constraint(grads, run.param_shardings)
    (loss, aux, grads), _ = jax.lax.scan(body, (loss, aux, grads), micro)
    return jax.tree.map(lambda x: x / A, (loss, aux, grads))


def make_train_step(run: Run):
    tx, schedule = run.tx, run.schedule

    def step(state, batch):
        params = state["params"]
        loss, aux, grads = accumulated_grads(run, params, batch)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        aux = dict(aux)
        metrics = {"loss": aux.pop("lm_loss"), "grad_norm": optax.global_norm(grads),
                   "lr": schedule(state["step"])}
        if "gate_mean" in aux:
            gate_sq = aux.pop("gate_sq")
            metrics["gate_std"] = jnp.sqrt(jnp.maximum(gate_sq - aux["gate_mean"] ** 2, 0.0))
        if "moe_load" in aux:  # one scalar per expert, for the log
            load = aux.pop("moe_load")
            metrics.update({f"moe_load_{e}": load[e] for e in range(load.shape[0])})
        metrics.update(aux)
        return {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    replicated = NamedSharding(run.mesh, P())
    return jax.jit(
        sharding.under_rules(step, run.mesh),
        in_shardings=(run.state_shardings, run.batch_sharding),
        out_shardings=(run.state_shardings, replicated),
        donate_argnums=0,
    )


def make_eval_step(run: Run, table: str | None = None):
    """Sum of NLL and token count over a [b, T+1] batch with per-window weights (padding)."""
    graphdef = run.graphdef

    def nll_sum(params, tokens, weights):
        model = model_lib.bind(graphdef, params)
        lp = model.target_log_probs(tokens[:, :-1], tokens[:, 1:], table=table)
        return -jnp.sum(lp * weights[:, None]), jnp.sum(weights) * lp.shape[1]

    replicated = NamedSharding(run.mesh, P())
    return jax.jit(
        sharding.under_rules(nll_sum, run.mesh),
        in_shardings=(run.param_shardings, run.batch_sharding, NamedSharding(run.mesh, P(("data", "fsdp")))),
        out_shardings=(replicated, replicated),
    )


def global_batch(run: Run, local: np.ndarray) -> jax.Array:
    """This process's rows of the global batch -> one global array sharded over data×fsdp."""
    return jax.make_array_from_process_local_data(run.batch_sharding, local)


def evaluate(run: Run, params, windows: np.ndarray, tables=(None,), batch: int = 8) -> dict:
    """Mean NLL over fixed windows (every process holds all of them), per table variant."""
    dp = run.dp
    b = max(dp, math.ceil(batch / dp) * dp)
    n = len(windows)
    padded = math.ceil(n / b) * b
    tokens = np.zeros((padded, windows.shape[1]), np.int32)
    tokens[:n] = windows
    weights = np.zeros((padded,), np.float32)
    weights[:n] = 1.0
    w_sharding = NamedSharding(run.mesh, P(("data", "fsdp")))
    out = {}
    for table in tables:
        if table not in run.eval_steps:
            run.eval_steps[table] = make_eval_step(run, table)
        fn = run.eval_steps[table]
        total, count = 0.0, 0.0
        for i in range(0, padded, b):
            tb = jax.make_array_from_callback((b, tokens.shape[1]), run.batch_sharding, lambda idx: tokens[i:i + b][idx])
            wb = jax.make_array_from_callback((b,), w_sharding, lambda idx: weights[i:i + b][idx])
            s, c = fn(params, tb, wb)
            total, count = total + s, count + c
        out["val_loss" if table is None else f"val_loss_{table}_only"] = float(total / count)
    return out


# ----------------------------------------------------------------------------- the loop


class NonFiniteLoss(RuntimeError):
    pass


class Preemption:
    """SIGTERM sets a flag; the loop saves a checkpoint after the step in flight and exits."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        if jax.process_count() == 1:  # several hosts agree through jax's preemption sync point
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def reached(self, step: int) -> bool:
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


class MetricsLog:
    """metrics.jsonl (one JSON object per logged step) and TensorBoard, from process 0 only."""

    def __init__(self, workdir: str):
        self.primary = jax.process_index() == 0
        if self.primary:
            from tensorboardX import SummaryWriter

            self.jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")
            self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: dict):
        if not self.primary:
            return
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        for k, v in metrics.items():
            self.tb.add_scalar(k, v, step)

    def close(self):
        if self.primary:
            self.jsonl.close()
            self.tb.close()


def prepare_data(cfg, workdir: str) -> str:
    """The token shards: cfg.data.dir, or the bundled corpus prepared once into the workdir."""
    from onona_jax.data import pipeline

    if cfg.data.dir:
        return cfg.data.dir
    data_dir = os.path.join(workdir, "data")
    if jax.process_index() == 0:
        pipeline.ensure_bundled_data(data_dir, cfg.data.seq_len)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("bundled data prepared")
    return data_dir


def train(cfg, workdir: str, devices=None, progress: bool = True) -> dict:
    """Train (or resume) in `workdir`; returns the final evaluation."""
    from tqdm import tqdm

    from onona_jax.data import pipeline

    run = setup(cfg, devices)  # every config check, before any write
    if cfg.data.dir:  # user data: check it before writing anything
        pipeline.TokenStore(cfg.data.dir, "train", vocab_size=cfg.model.vocab_size).num_windows(cfg.data.seq_len)
        pipeline.validation_windows(cfg.data.dir, cfg.data.seq_len, cfg.eval.windows, cfg.eval.seed)
    if cfg.init_from and not os.path.isdir(os.path.join(cfg.init_from, "checkpoints")):
        raise ValueError(f"init_from={cfg.init_from!r} has no checkpoints/; give a standard run's workdir")
    os.makedirs(workdir, exist_ok=True)
    data_dir = prepare_data(cfg, workdir)
    val_windows = pipeline.validation_windows(data_dir, cfg.data.seq_len, cfg.eval.windows, cfg.eval.seed)
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(cfg.to_json(indent=2))

    ckpts = Checkpoints(os.path.join(workdir, "checkpoints"), keep=cfg.train.keep_checkpoints)
    restored = ckpts.restore_latest(abstract_train_state(run))
    batches = pipeline.train_batches(
        data_dir, cfg.data.seq_len, cfg.train.global_batch, seed=cfg.data.seed,
        process_index=jax.process_index(), process_count=jax.process_count(),
    )
    if restored is None:
        start, state = 0, init_state(run, cfg.seed)
        if cfg.init_from:
            state = upcycle(run, state, cfg.init_from)
    else:
        start, state, data_state, _ = restored
        batches.set_state(data_state)
        print(f"resumed from step {start} in {ckpts.directory}", file=sys.stderr)

    is_twin = cfg.model.head == "twin"
    train_step = make_train_step(run)
    all_finite = jax.jit(lambda t: jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(t)])),
                         out_shardings=NamedSharding(run.mesh, P()))
    tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
    flops = summary.flops_per_token(cfg.model, cfg.data.seq_len)["train"]
    peak = peak_tflops(cfg)
    log = MetricsLog(workdir)
    pending: list[tuple[int, dict]] = []
    last_time, last_step = time.perf_counter(), start
    bar = tqdm(total=run.steps, initial=start, disable=not progress or jax.process_index() != 0,
               dynamic_ncols=True, desc=cfg.name or "train")

    def flush():
        """Bring logged metrics to the host (one transfer per log interval); stop on NaN."""
        nonlocal last_time, last_step
        if not pending:
            return
        host = jax.device_get([m for _, m in pending])
        now = time.perf_counter()
        tok_s = (pending[-1][0] - last_step) * tokens_per_step / max(now - last_time, 1e-9)
        last_time, last_step = now, pending[-1][0]
        for (s, _), m in zip(pending, host):
            m = {k: float(v) for k, v in m.items()}
            if not math.isfinite(m["loss"]):
                raise NonFiniteLoss(
                    f"non-finite loss {m['loss']} at step {s}; stopping. The last good checkpoint "
                    f"(step {ckpts.latest()}) is untouched; lower train.lr or check the data"
                )
            m["tokens_per_s"] = tok_s
            if peak:
                m["mfu"] = tok_s * flops / (peak * 1e12 * jax.device_count())
            log.write(s, m)
        bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{tok_s:,.0f}")
        pending.clear()

    def save(step):
        flush()  # never save parameters that produced a non-finite loss,
        if not bool(all_finite(state)):  # nor non-finite ones behind a finite loss (an inf lr, a preemption)
            raise NonFiniteLoss(
                f"non-finite parameters or optimizer state after step {step}; not saving them. "
                f"The last good checkpoint (step {ckpts.latest()}) is untouched; lower train.lr or check the data"
            )
        ckpts.save(step, state, batches.get_state(), cfg.to_json())

    def validate(step, tables=(None,)):
        result = evaluate(run, state["params"], val_windows, tables, cfg.eval.batch)
        log.write(step, result)
        return result

    result = {}
    try:
        with Preemption() as preempt:
            if start == 0 and cfg.init_from:  # the upcycled model's starting point, logged
                validate(0)
            for step in range(start + 1, run.steps + 1):
                state, metrics = train_step(state, global_batch(run, next(batches)))
                bar.update(1)
                if step % cfg.train.log_every == 0 or step == run.steps:
                    pending.append((step, metrics))
                    flush()
                elif step % cfg.train.checkpoint_every == 0 or step % cfg.train.eval_every == 0:
                    pending.append((step, metrics))
                if step % cfg.train.eval_every == 0 and step != run.steps:
                    validate(step)
                if step % cfg.train.checkpoint_every == 0 or step == run.steps:
                    save(step)
                if preempt.reached(step) and step != run.steps:
                    save(step)
                    ckpts.wait()
                    print(f"pre-empted: saved step {step}; rerun the same command to resume",
                          file=sys.stderr)
                    return {"step": step, "preempted": True}
            ckpts.wait()
            result = validate(run.steps, (None, "a", "b") if is_twin else (None,))
    finally:
        bar.close()
        log.close()
        ckpts.wait()
    result["step"] = run.steps
    return result
