"""The config schema (every key, with the paper's defaults) and its validation.

Experiment files in `configs/` start from `base_config()` and set what differs; `validate`
runs before anything is compiled or written, so a bad value fails with a message that names
the key and the fix.
"""

from __future__ import annotations

import importlib.util
import math
import os

import ml_collections

from onona_jax import attention
from onona_jax import cli
from onona_jax import compile_cache
from onona_jax import heads as heads_lib
from onona_jax import layers
from onona_jax import models
from onona_jax.models import gdn

# The choices of model.arch and model.head come from the registries (one place each); ARCHS
# are the package's own families (`validate` reads the registry itself: `models.register`).
ARCHS = tuple(models.FAMILIES)
HEADS = tuple(heads_lib.HEADS)


BUDGETS = ("tokens", "flops", "params")  # train.budget (summary.budget)
PACKINGS = ("windows", "documents")  # data.packing (onona_jax/packing.py)


def parse_reference(text: str, cfg_model) -> dict:
    """train.reference "n_layers=24,d_ff=2048" -> {"n_layers": 24, "d_ff": 2048}: integer model keys
    (moe.d_expert's dotted form too); anything else a ValueError naming the form."""
    out = {}
    for item in filter(None, (s.strip() for s in str(text).split(","))):
        key, _, value = item.partition("=")
        node = cfg_model
        for part in key.split(".")[:-1]:
            node = node.get(part) if isinstance(node, ml_collections.ConfigDict) else None
        leaf = key.split(".")[-1]
        if not isinstance(node, ml_collections.ConfigDict) or not isinstance(node.get(leaf), int) \
                or not value.strip().isdigit() or int(value) <= 0:
            raise ValueError(f"train.reference={text!r}: expected <model key>=<positive integer>,... of the "
                             "model's integer keys (e.g. n_layers=24,d_ff=2048), or '' for this model's own shape")
        out[key] = int(value)
    return out


def ffn_width(d: int) -> int:
    """8d/3 rounded up to a multiple of 64 (SPEC §3)."""
    return 64 * math.ceil(8 * d / 3 / 64)


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = ""
    c.seed = 0
    c.init_from = ""  # workdir of a standard run to upcycle from: A = B = E, body copied

    c.model = m = ml_collections.ConfigDict()
    m.arch = "dense"
    m.head = "twin"
    m.vocab_size = 0  # table rows; 0: the tokenizer's entries rounded up to vocab_multiple (GPT-2: 50,304)
    m.vocab_multiple = 128  # so the vocabulary projection tiles evenly (MXU, tensor-parallel shards)
    m.d_model = 768
    m.n_layers = 16
    m.n_heads = 12
    m.n_kv_heads = 6
    m.head_dim = 64
    m.d_ff = 2048
    m.rope_theta = 10_000.0
    m.norm_eps = 1e-6
    # The vocabulary tables' init std is table_init_scale × 0.02, every table of the head (the
    # gate and the body unchanged). The init-scale control (experiments/grids.py, grid init_scale):
    # twin at √2 starts M = (A+B)/2 at Standard's std 0.02; Standard at 1/√2 starts E at M's 0.0141.
    m.table_init_scale = 1.0
    m.dtype = "bfloat16"  # compute dtype; parameters and optimizer state stay fp32
    m.scan_layers = True
    m.remat = "none"  # none | dots | attention | attention_experts | attention_offload | full (layers.REMAT_POLICIES)
    m.attention_impl = "auto"  # auto: splash on TPU, cuDNN on GPU (bf16), XLA on CPU | xla | splash | cudnn (attention.py)
    m.loss = "fused"  # fused: gradients in the forward pass, tiled over tokens (loss.py) | fused_vocab: chunked over the vocabulary, backward recomputes (loss_vocab.py) | plain
    m.loss_token_tile = 0  # tokens per tile (per device) of the fused loss; 0: 256 on TPU/GPU, 512 on CPU (loss.py says why)
    m.loss_chunk = 2048  # vocabulary rows per tile of the fused_vocab loss (docs/notes/performance-log.md: fastest on CPU, smallest at 142M)
    m.mos_components = 2  # K of the mos / moss heads
    m.layer_pattern = ""  # "" = the arch's: "attention", or "gdn,gdn,gdn,attention" for gdn

    m.moe = ml_collections.ConfigDict()  # arch=moe: every layer's FFN (SPEC §3)
    m.moe.n_experts = 8
    m.moe.top_k = 2
    m.moe.d_expert = 1024
    m.moe.renormalize = False  # renormalise the top-k router weights to sum to 1
    m.moe.capacity_factor = 1.25  # training and validation; 0 = dropless
    m.moe.eval_capacity_factor = 4.0  # perplexity and downstream evaluation
    m.moe.aux_coef = 0.001  # Switch load-balancing loss, pooled over layers
    # auto: grouped (ragged_dot; TPU/GPU, mesh.expert > 1) else sort | grouped | sort (gather) | dense (einsum)
    m.moe.dispatch = "auto"

    m.gdn = ml_collections.ConfigDict()  # arch=gdn: Gated DeltaNet layers (SPEC §3)
    m.gdn.n_heads = 6
    m.gdn.head_dim_k = 128
    m.gdn.head_dim_v = 128
    m.gdn.conv_kernel = 4
    m.gdn.chunk = 64
    # the recurrence's matmuls: default (bf16 operands, fp32 accumulation; the state stays fp32)
    # | highest (fp32 at Precision.HIGHEST: multi-pass on TPU). A saved config without the key
    # predates it and was trained at highest: from_saved restores it as highest.
    m.gdn.precision = gdn.DEFAULT_PRECISION

    m.attnres = ml_collections.ConfigDict()  # arch=attnres: Attention Residuals
    m.attnres.block_size = 1  # sublayers per block; 1 = full AttnRes

    c.train = t = ml_collections.ConfigDict()
    t.steps = 0  # the reference's steps (below); 0: tokens_per_param × the Dense Standard parameters
    t.tokens_per_param = 40.0
    # What every arm of a size is matched on (summary.budget), against the reference: the Dense
    # Standard model of this size trained train.steps (or tokens_per_param × its parameters):
    # tokens (the same steps: the paper's) | flops (the reference's training FLOPs over this model's
    # FLOPs per token: a twin arm trains fewer tokens) | params (tokens in proportion to this model's
    # own parameters: tokens_per_param × its total).
    t.budget = "tokens"
    # Where the reference differs from this model's shape, as model keys: "n_layers=24" (the depth
    # control), "d_ff=2048" (the parameter-matched Standard); "" = this model's own shape. The grids'
    # rules set it, so that a deeper or wider control trains the budget of its size, not its own.
    t.reference = ""
    t.global_batch = 256
    t.micro_batch = 16  # per data-parallel replica; 0 = global_batch / replicas (no accumulation)
    t.lr = 1e-3
    t.final_lr = 1e-4
    t.warmup_steps = 1000
    t.decay_fraction = 0.2
    t.b1 = 0.9
    t.b2 = 0.95
    t.eps = 1e-8
    t.weight_decay = 0.1
    t.decay_vectors = False  # weight decay on vectors (norm weights, the gate) too?
    t.grad_clip = 1.0
    t.log_every = 10
    t.eval_every = 500
    t.checkpoint_every = 1000
    t.keep_checkpoints = 3  # of the scheduled saves; a timer save lives until the next save is complete
    # Minutes between timer saves, besides checkpoint_every's, checked at logged steps; 0 = none.
    # Off by default: a pre-emption notice (SIGTERM) already saves; the timer is for runs whose
    # checkpoint_every spans more wall-clock than a crash without notice may cost (e.g. 10 on a pod).
    t.checkpoint_minutes = 0.0
    t.wandb_project = ""  # Weights & Biases project to log to as well ("" = TensorBoard only); `[wandb]` extra
    t.peak_tflops = 0.0  # per device, for MFU; 0: look up from the device kind
    # JAX's persistent compilation cache: a restart (after a pre-emption) loads the compiled step
    # instead of compiling it again. A local directory or a bucket URL; "" = off.
    t.compile_cache = compile_cache.default_dir()
    t.compile_cache_min_s = 1.0  # cache only programs that took this long to compile (not the small ones)
    # A jax.profiler trace of steps profile_start .. profile_start + profile_steps - 1 into
    # <workdir>/profile/ (TensorBoard's profile plugin, Perfetto); profile_start=0: no trace.
    t.profile_start = 0
    t.profile_steps = 3
    t.profile_all_hosts = False  # False: process 0 alone traces
    # Downstream tasks scored during training on the live parameters, by eval.py's code
    # (onona_jax/eval/tasks: `Downstream`), logged as task/<name>/<metric>. tasks: eval.py's
    # --tasks names, comma-separated, without val (that is train.eval_every's); "" = none.
    # task_data ("name=PATH,...") and task_data_dir: where the files are, as eval.py's --task_data
    # and --task_data_dir (nothing is bundled or downloaded); every host reads its own copy.
    # tasks_every: steps between scorings, besides the last step's (0 = the last step only);
    # tasks_limit: the first N examples of each task (MMLU: per subject), as eval.py's --limit; 0 = all.
    # Scored at max_length = data.seq_len, eval.batch rows a batch, MMLU 5-shot (eval.py's
    # numbers with --max_length=<data.seq_len> --task_batch=<eval.batch>).
    t.tasks = ""
    t.task_data = ""
    t.task_data_dir = ""
    t.tasks_every = 0
    t.tasks_limit = 0

    c.data = dt = ml_collections.ConfigDict()
    dt.dir = ""  # prepared token shards; "" = the bundled corpus, prepared into the workdir; may be gs://...
    # A weighted mixture of prepared data dirs instead of data.dir: "name:dir:weight,..." (e.g.
    # "web:gs://bucket/web:0.7,code:/data/code:0.3"; weights relative), each source's batches'
    # share within one slot of its weight, each scored apart (val_loss/<name>); data/mixture.py.
    dt.mixture = ""
    dt.cache_dir = ""  # local copy of a bucket data.dir's shards; "" = <system temp dir>/onona-data-cache
    # How a bucket data.dir is read: "copy" = every shard copied whole into cache_dir, then memory-
    # mapped; "stream" = each host fetches only the blocks of its own rows by ranged reads, each
    # verified against prepare's block hashes (onona_jax/data/stream.py). The same batches either way.
    dt.bucket_read = "copy"
    # The tokenizer (onona_jax/tokenizer.py): gpt2 (bundled), a tiktoken rank file, a HF tokenizer.json
    # or its folder, or size:<entries> (planning only). prepare records it; train and eval refuse data
    # of another. eot names the end-of-document token where the tokenizer does not say; a rank
    # file's special tokens ("<tok>=<id>,...") and split pattern (gpt2 | cl100k | o200k | a regex).
    dt.tokenizer = "gpt2"
    dt.eot = ""
    dt.special_tokens = ""
    dt.tokenizer_pattern = ""
    dt.seq_len = 1024
    dt.seed = 0
    # How documents share a window. "windows" (the paper's): each window of seq_len + 1 tokens is
    # one sequence, attention, RoPE and GDN's state running across end-of-text tokens. "documents":
    # each end-of-text token ends a document (onona_jax/packing.py): attention never crosses one,
    # positions restart after it and GDN's state resets; the target after it (the next
    # document's first token) is left out of the loss. The same batches either way.
    dt.packing = "windows"
    # grain's reads: threads per process (0 = in the training loop's own thread) and batches
    # read ahead. The batches do not depend on either (grain keeps the order).
    dt.read_threads = 1
    dt.prefetch = 2

    c.eval = e = ml_collections.ConfigDict()
    e.windows = 1024
    e.seed = 1234
    e.batch = 8

    c.mesh = ms = ml_collections.ConfigDict()
    ms.data = -1
    ms.fsdp = 1
    ms.expert = 1  # expert parallelism (MoE): n_experts must divide by it; elsewhere more FSDP
    ms.tensor = 1
    # TPU slices joined by DCN (a multi-slice job): the axes above then describe one slice, and
    # the data axis is slices × data, the only axis that crosses slices (sharding.make_mesh)
    ms.slices = 1
    return c


def validate(cfg: ml_collections.ConfigDict, training: bool = True) -> ml_collections.ConfigDict:
    """Raise ValueError naming the key and the fix; return cfg otherwise, with model.vocab_size
    filled in from data.tokenizer where it is 0 (the one key validation resolves).

    Every number of the config must be finite (whatever its key, so a key added later is
    covered too), and every value a run reads lies in its range: the model (its family's
    checks, `Family.validate` and `Family.mesh_problems`: the MoE and GDN keys when the model
    has MoE or GDN layers; every
    parameter of the abstract model in exactly one of its family's summary rows), the
    optimizer and its schedule, the data, the evaluation and the mesh. `training=False`: a
    saved run's config for a reader (evaluation, serving, export), which reads no train.*
    key, so a run trained under older, looser rules stays readable."""
    m = cfg.model

    def need(ok: bool, msg: str):
        if not ok:
            raise ValueError(f"config {cfg.get('name') or ''!s}: {msg}")

    # First, so that no range check below reads a NaN (it compares False with every bound).
    defaults = flatten(base_config())
    for key, value in flatten(cfg).items():
        if training or not key.startswith("train."):
            need(not isinstance(value, float) or math.isfinite(value),
                 f"{key}={value} is not a finite number; give a finite value (its default is {defaults.get(key)})")

    need(m.arch in models.FAMILIES, f"unknown model.arch {m.arch!r}; choose one of {tuple(models.FAMILIES)}")
    need(m.head in heads_lib.HEADS, f"unknown model.head {m.head!r}; choose one of {tuple(heads_lib.HEADS)}")
    _resolve_vocab(cfg, need)
    for key in ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size"):
        need(int(m[key]) > 0, f"model.{key} must be positive, got {m[key]}")
    need(
        m.n_heads % m.n_kv_heads == 0,
        f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}; "
        "grouped-query attention needs whole groups",
    )
    need(
        m.d_model % m.n_heads == 0,
        f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}",
    )
    need(m.head_dim % 2 == 0, f"model.head_dim={m.head_dim} must be even for RoPE")
    need(m.rope_theta > 0, f"model.rope_theta={m.rope_theta} must be positive (RoPE's base, e.g. 10000.0)")
    need(m.norm_eps > 0, f"model.norm_eps={m.norm_eps} must be positive (RMSNorm divides by sqrt(mean + eps))")
    need(m.table_init_scale > 0,
         f"model.table_init_scale={m.table_init_scale} must be positive (the vocabulary tables' init std is it × 0.02; "
         "1.0 = the paper's)")
    need(m.dtype in ("float32", "bfloat16"), f"model.dtype {m.dtype!r}: float32 or bfloat16")
    need(m.remat in layers.REMAT_POLICIES, f"model.remat {m.remat!r}: one of {', '.join(layers.REMAT_POLICIES)}")
    need(m.attention_impl != "blocked",
         "model.attention_impl 'blocked' was retired (`xla` computes query blocks itself on CPU, and splash and "
         "cuDNN skip the masked blocks on accelerators): use auto")
    need(m.attention_impl in attention.IMPLS + (None,),
         f"model.attention_impl {m.attention_impl!r}: one of {', '.join(attention.IMPLS)}")
    for problem in attention.check_shape(m.attention_impl, m.head_dim):
        need(False, problem)
    need(m.loss in ("fused", "fused_vocab", "plain"), f"model.loss {m.loss!r}: fused, fused_vocab or plain")
    need(m.loss_token_tile >= 0, f"model.loss_token_tile={m.loss_token_tile}: a positive number of tokens, or 0 for the platform's default")
    need(m.loss_chunk > 0, f"model.loss_chunk={m.loss_chunk} must be positive")
    need(m.mos_components >= 1, f"model.mos_components={m.mos_components} must be at least 1 (K of the mos/moss heads)")
    pattern = models.layer_pattern(m)
    need(
        set(pattern) <= set(models.MIXERS),
        f"model.layer_pattern {m.layer_pattern!r}: a comma list of {', '.join(models.MIXERS)}",
    )
    need(
        m.n_layers % len(pattern) == 0,
        f"model.n_layers={m.n_layers} is not a multiple of the layer pattern's length {len(pattern)}",
    )
    for problem in models.family(m).validate(m):
        need(False, problem)
    # The summary (the training loop's FLOPs, the budget) counts every parameter in the row
    # its family declares: a path it cannot place fails here, not after the run's first write.
    for problem in models.accounting_problems(m):
        need(False, problem)
    if training:
        _validate_training(cfg, need, defaults)
    need(cfg.data.seq_len > 0, f"data.seq_len={cfg.data.seq_len} must be positive (tokens per window)")
    _validate_mixture(cfg.data, need)
    need(cfg.eval.windows > 0, f"eval.windows={cfg.eval.windows} must be positive")
    need(cfg.eval.batch > 0, f"eval.batch={cfg.eval.batch} must be positive")
    need(cfg.eval.seed >= 0, f"eval.seed={cfg.eval.seed} must be zero or positive")
    sizes = {f"mesh.{k}": cfg.mesh[k] for k in ("data", "fsdp", "expert", "tensor")}
    for key, size in sizes.items():
        need(size > 0 or size == -1, f"{key}={size} must be positive, or -1 (the devices the other axes leave)")
    need(list(sizes.values()).count(-1) <= 1,
         f"{', '.join(f'{k}={v}' for k, v in sizes.items())}: at most one mesh axis may be -1")
    need(isinstance(cfg.mesh.slices, int) and cfg.mesh.slices >= 1,
         f"mesh.slices={cfg.mesh.slices} must be a positive integer: the TPU slices of a multi-slice job "
         "(1 = one slice)")
    for problem in models.family(m).mesh_problems(m, cfg.mesh):
        need(False, problem)
    return cfg


def _validate_mixture(data, need):
    """data.mixture parses (data/mixture.py names what is wrong), and is not given beside data.dir."""
    from onona_jax.data import mixture

    try:
        entries = mixture.parse(data.get("mixture", ""))
    except ValueError as err:
        need(False, f"{err} (data.mixture={data.mixture!r})")
    need(not entries or not data.dir,
         f"data.dir={data.dir!r} and data.mixture={data.mixture!r} are both given; data.mixture names every "
         "source's data dir: give one of them (--config.data.dir='' with a mixture)")


def _resolve_vocab(cfg, need):
    """model.vocab_size from data.tokenizer (in place): its entries rounded up to
    model.vocab_multiple. A config that names a size of its own must name that one."""
    from onona_jax import tokenizer as tokenizer_lib

    m = cfg.model
    need(isinstance(m.vocab_multiple, int) and m.vocab_multiple > 0,
         f"model.vocab_multiple={m.vocab_multiple} must be a positive integer (table rows are the tokenizer's "
         "entries rounded up to it; 128 tiles the projection evenly)")
    try:
        tok = tokenizer_lib.from_config(cfg.data)
    except (ValueError, OSError) as err:
        need(False, str(err))
    want = tok.padded_vocab(m.vocab_multiple)
    if not m.vocab_size:
        m.vocab_size = want
    need(m.vocab_size == want,
         f"model.vocab_size={m.vocab_size} disagrees with data.tokenizer={cfg.data.tokenizer!r}: {tok.describe()} "
         f"rounded up to model.vocab_multiple={m.vocab_multiple} is {want}; leave model.vocab_size at 0 (it follows "
         f"the tokenizer) or set {want}")


def _validate_training(cfg, need, defaults):
    """What only training reads: the train.* keys (the step budget, the batch, the schedule,
    AdamW and the clip) and the seeds of the initialisation and the data order."""
    # jax.random.key and the data order take 32 bits (key(2**32) is key(0)).
    need(0 <= cfg.seed < 2**32, f"seed={cfg.seed} must lie in [0, 2**32)")
    need(0 <= cfg.data.seed < 2**32, f"data.seed={cfg.data.seed} must lie in [0, 2**32)")
    need(cfg.data.get("packing", "windows") in PACKINGS,
         f"data.packing={cfg.data.get('packing')!r} must be one of {', '.join(PACKINGS)} (\"windows\": the paper's "
         "windows across documents; \"documents\": attention, positions and GDN's state restart at each document)")
    need(cfg.data.bucket_read in ("copy", "stream"),
         f"data.bucket_read={cfg.data.bucket_read!r} must be \"copy\" (shards copied to data.cache_dir) or "
         "\"stream\" (ranged, verified reads of each host's own rows)")
    for key in ("read_threads", "prefetch"):
        need(isinstance(cfg.data[key], int) and cfg.data[key] >= 0,
             f"data.{key}={cfg.data[key]} must be an integer ≥ 0 (read threads per process, 0 = the loop's own "
             "thread; batches read ahead, 0 = none)")
    need(cfg.data.prefetch == 0 or cfg.data.prefetch >= cfg.data.read_threads,
         f"data.prefetch={cfg.data.prefetch} is below data.read_threads={cfg.data.read_threads}: grain reads at "
         "most as many batches at once as it buffers; raise data.prefetch to at least data.read_threads")
    t = cfg.train
    need(t.steps >= 0, f"train.steps={t.steps} must be positive (or 0: derived from train.tokens_per_param)")
    need(t.steps > 0 or t.tokens_per_param > 0,
         f"train.tokens_per_param={t.tokens_per_param} must be positive when train.steps=0 derives the budget")
    try:
        parse_reference(t.reference, cfg.model)
    except ValueError as err:
        need(False, str(err))
    need(t.budget in BUDGETS, f"train.budget={t.budget!r}: one of {', '.join(BUDGETS)} (what every arm is "
         "matched on: the same tokens, the same training FLOPs or tokens in proportion to its parameters)")
    need(t.global_batch > 0, f"train.global_batch={t.global_batch} must be positive (sequences per step)")
    need(t.micro_batch >= 0, f"train.micro_batch={t.micro_batch} must be positive, or 0 for no accumulation")
    # The schedule (optimizer.wsd): warmup to lr, constant, linear decay to final_lr.
    need(t.lr > 0, f"train.lr={t.lr} must be positive (a negative one ascends the loss)")
    need(0 <= t.final_lr <= t.lr,
         f"train.final_lr={t.final_lr} must lie in [0, train.lr={t.lr}] (where the decay ends; above train.lr "
         "the schedule would never decay): lower train.final_lr with train.lr")
    need(t.warmup_steps >= 0, f"train.warmup_steps={t.warmup_steps} must be zero or positive")
    need(0 <= t.decay_fraction <= 1, f"train.decay_fraction={t.decay_fraction} must lie in [0, 1]")
    # AdamW (optax.adamw) and the gradient clip before it.
    for key in ("b1", "b2"):
        need(0 <= t[key] < 1, f"train.{key}={t[key]} must lie in [0, 1) (Adam's moment decay rate; "
             f"default {defaults[f'train.{key}']})")
    need(t.eps > 0, f"train.eps={t.eps} must be positive (Adam divides by sqrt(v) + eps; default {defaults['train.eps']})")
    need(t.weight_decay >= 0, f"train.weight_decay={t.weight_decay} must be zero (off) or positive")
    need(t.grad_clip >= 0, f"train.grad_clip={t.grad_clip} must be positive (the largest global gradient norm) "
         "or 0 (no clipping); a negative one reverses the gradient")
    for key in ("log_every", "eval_every", "checkpoint_every", "keep_checkpoints"):
        need(t[key] > 0, f"train.{key}={t[key]} must be positive (a number of steps, or checkpoints kept)")
    need(t.checkpoint_minutes >= 0, f"train.checkpoint_minutes={t.checkpoint_minutes} must be positive (minutes "
         "between timer saves, besides train.checkpoint_every's) or 0 (no timer saves)")
    need(not t.wandb_project or importlib.util.find_spec("wandb") is not None,
         f"train.wandb_project={t.wandb_project!r} needs the wandb package, which is not installed: "
         "pip install -e '.[wandb]' (or train.wandb_project='' to log to TensorBoard only)")
    need(t.peak_tflops >= 0, f"train.peak_tflops={t.peak_tflops} must be positive (per device, for MFU) "
         "or 0 (looked up from the device kind)")
    need(isinstance(t.compile_cache, str), f"train.compile_cache={t.compile_cache!r} must be a directory, a bucket "
         "URL or '' (off)")
    need(t.compile_cache_min_s >= 0, f"train.compile_cache_min_s={t.compile_cache_min_s} must be zero or positive "
         "(seconds of compile below which a program is not cached)")
    need(isinstance(t.profile_start, int) and t.profile_start >= 0,
         f"train.profile_start={t.profile_start} must be a step number (the first step traced; 2 or later leaves "
         "out the compile) or 0 (no trace)")
    need(isinstance(t.profile_steps, int) and t.profile_steps >= 1,
         f"train.profile_steps={t.profile_steps} must be a positive number of steps to trace")
    # The task names and their files are checked at the run's start (train/downstream.py `resolve`,
    # before any compile or write): the task registry lives in onona_jax.eval, a layer above this one.
    for key in ("tasks", "task_data", "task_data_dir"):
        need(isinstance(t[key], str), f"train.{key}={t[key]!r} must be a string (train.tasks: task names, "
             "comma-separated; train.task_data: name=PATH,...; train.task_data_dir: a directory)")
    need(isinstance(t.tasks_every, int) and t.tasks_every >= 0,
         f"train.tasks_every={t.tasks_every} must be a number of steps between task scorings, or 0 (the last step only)")
    need(isinstance(t.tasks_limit, int) and t.tasks_limit >= 0,
         f"train.tasks_limit={t.tasks_limit} must be a number of examples per task, or 0 (all of them)")


# ----------------------------------------------------------------------------- resuming
#
# The keys a rerun on an existing workdir may change. Every other key changes the
# parameters, the optimizer state or the data stream (the model, the optimizer and its
# schedule, the data and its order, the validation windows), so a rerun that changes one is
# a different run: train.py stops with exit 2 and names the differing keys
# (train/resume.py, the one place that rules on a resume). Listed in the docs/training.md ("Resuming with a changed config").
RESUMABLE_KEYS = (
    "name",                  # a label
    "train.steps",           # the budget, while the WSD decay has not begun (train/resume.py check_schedule)
    "data.dir", "data.cache_dir",  # the same data elsewhere: its identity is compared (train/resume.py check_same_data)
    # Its weights may change (recorded in metrics.jsonl); its sources, by name and identity, not
    # (train/resume.py check_same_data)
    "data.mixture",
    "data.bucket_read",      # copied or streamed: the same batches
    "data.read_threads", "data.prefetch",  # how the batches are read, not which
    "train.log_every", "train.eval_every", "train.checkpoint_every", "train.keep_checkpoints",
    "train.checkpoint_minutes", "train.wandb_project",  # when to save, where else to log
    "train.peak_tflops",     # MFU's denominator
    "train.compile_cache", "train.compile_cache_min_s",  # where compiled programs are kept: not what they compute
    "train.profile_start", "train.profile_steps", "train.profile_all_hosts",  # a trace, read-only
    # downstream tasks scored on the parameters, read-only: what is measured and when, not what is trained
    "train.tasks", "train.task_data", "train.task_data_dir", "train.tasks_every", "train.tasks_limit",
    "train.micro_batch",     # gradient accumulation: the same global batch in other slices
    "eval.batch",            # rows per validation batch
    "mesh.data", "mesh.fsdp", "mesh.expert", "mesh.tensor", "mesh.slices",  # checkpoints restore onto any mesh
    "model.remat", "model.attention_impl", "model.moe.dispatch",  # how the step is computed, not what
    "model.gdn.precision",   # likewise: the recurrence's matmuls, the same function to bf16 rounding
)


def set_key(cfg, key: str, value) -> None:
    """cfg["a.b.c"] = value for a dotted key (a ConfigDict or dict, in place)."""
    *path, leaf = key.split(".")
    node = cfg
    for part in path:
        node = node[part]
    node[leaf] = value


def flatten(d, prefix: str = "") -> dict:
    """{"train.lr": 0.001, ...} of a (nested) dict or ConfigDict."""
    if isinstance(d, ml_collections.ConfigDict):
        d = d.to_dict()
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def from_saved(saved: dict, where: str = "") -> ml_collections.ConfigDict:
    """A config saved by this or an older version: keys it lacks (added since) take their
    defaults, with a notice; unknown keys (a newer version's) are an error naming them.

    One exception: a config without model.gdn.precision was saved when GDN's recurrence ran
    at fp32 HIGHEST, so it restores as `highest` (what the run was trained at), not as the
    new default. A reader (evaluation, serving, export) computes as the run was trained; a
    resumed training run takes the command line's value (the key is in RESUMABLE_KEYS), i.e.
    the new default unless --config.model.gdn.precision=highest."""
    import sys

    base = base_config()
    have, known = flatten(saved), flatten(base)
    unknown = sorted(set(have) - set(known))
    where = where or "the checkpoint"
    if unknown:
        raise ValueError(f"the config saved in {where} has keys this version does not know "
                         f"({', '.join(unknown)}); a newer onona-jax wrote it: update this checkout")
    missing = sorted(set(known) - set(have))
    if "model.gdn.precision" in missing:
        missing.remove("model.gdn.precision")
        have["model.gdn.precision"] = "highest"
        pattern = have.get("model.layer_pattern") or ("gdn" if have.get("model.arch") == "gdn" else "")
        if "gdn" in pattern:
            print(f"notice: the config saved in {where} predates model.gdn.precision; using 'highest', "
                  "the fp32 recurrence it was trained with", file=sys.stderr)
    if missing:
        print(f"notice: the config saved in {where} predates keys {', '.join(missing)}; "
              "using their defaults", file=sys.stderr)
    if have.get("model.attention_impl") == "blocked":  # retired: the same attention (xla blocks it on CPU)
        print(f"notice: the config saved in {where} asks for model.attention_impl 'blocked', which was retired; "
              "using 'xla' (the same values to fp32 rounding)", file=sys.stderr)
        have["model.attention_impl"] = "xla"
    for key, value in have.items():
        *path, leaf = key.split(".")
        node = base
        for p in path:
            node = node[p]
        with node.ignore_type():
            node[leaf] = value
    return base


def define_flag(fv, argv, default: str | None = "configs/paper.py:dense-small-twin", name: str = "config"):
    """`--config=<file>.py:<arg>` and its `--config.<key>=<value>` overrides (ml-collections
    config flags) on the FlagValues `fv`, for the command line `argv`. An override of a key
    that does not exist is one error naming the key, its neighbours and where every key is.
    Returns the explainer `cli.run` calls when an override fails at parse time."""
    from ml_collections import config_flags

    from onona_jax.cli import UsageError

    spec = cli.flag_value(argv, name, default)
    if spec is not None:  # config_flags would put a traceback into its message, or defer the error
        try:
            from_spec(spec)
        except ValueError as err:
            raise UsageError(f"--{name}={spec}: {err}") from None
    try:
        config_flags.DEFINE_config_file(name, default, "configs/<file>.py:<arg>", flag_values=fv,
                                        lock_config=True, sys_argv=list(argv))
    except (AttributeError, KeyError) as err:
        raise UsageError(unknown_override(argv, default, name) or f"bad config override: {err}") from None
    return lambda argv: unknown_override(argv, default, name)


def overridden(cfg, argv, name: str = "config") -> dict:
    """{dotted key: value} of the `--config.<key>=...` overrides in `argv`, as the config flag
    parsed them into `cfg` (a command that applies them to configs of its own making)."""
    keys = [a[len(name) + 3:].split("=", 1)[0] for a in argv if a.startswith(f"--{name}.")]
    out = {}
    for key in keys:
        node = cfg
        for part in key.split("."):
            node = node[part]
        out[key] = node
    return out


def unknown_override(argv, default: str | None, name: str = "config") -> str | None:
    """The error for an override of a config key that does not exist (ml-collections raises
    a bare AttributeError/KeyError from deep inside), or None."""
    import difflib

    try:
        cfg = load(cli.flag_value(argv, name, default))
    except Exception:  # noqa: BLE001 - not an unknown key after all: the original error speaks
        return None
    for arg in argv:
        if not arg.startswith(f"--{name}."):
            continue
        parts = arg[len(name) + 3:].split("=", 1)[0].split(".")
        node = cfg
        for i, part in enumerate(parts):
            if isinstance(node, ml_collections.ConfigDict) and part in node:
                node = node[part]
                continue
            parent = ".".join([name, *parts[:i]])
            keys = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
            close = difflib.get_close_matches(part, keys, 1)
            hint = (f"did you mean {parent}.{close[0]}?" if close else
                    f"{parent} has keys {', '.join(keys)}" if keys else f"{parent} is a value, not a group")
            return (f"unknown config key {name}.{'.'.join(parts)} in {arg!r}; {hint} "
                    "(every key, with its default, is in onona_jax/config.py)")
    return None


def load(spec: str) -> ml_collections.ConfigDict:
    """`configs/paper.py:dense-142m-twin` -> the validated ConfigDict (as config_flags would)."""
    try:
        cfg = from_spec(spec)
    except ValueError as err:
        raise ValueError(f"config {spec}: {err}") from None
    return validate(cfg)


CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def _config_files() -> str:
    """Where the config files are, for a message."""
    files = sorted(f for f in os.listdir(CONFIGS_DIR) if f.endswith(".py")) if os.path.isdir(CONFIGS_DIR) else []
    where = os.path.relpath(CONFIGS_DIR) if not os.path.relpath(CONFIGS_DIR).startswith("..") else CONFIGS_DIR
    return f"the config files are in {where}/: {', '.join(files) or 'none'}"


def _first_line(err: BaseException) -> str:
    text = (str(err).strip().splitlines() or [""])[0]
    return text if isinstance(err, ValueError) and text else f"{type(err).__name__}: {text}".rstrip(": ")


def from_spec(spec: str) -> ml_collections.ConfigDict:
    """`<file>.py[:<arg>]` -> the file's `get_config(arg)` (unvalidated), as config_flags reads
    it. Whatever goes wrong (no such file, a file that fails to load, a name get_config does
    not know) is one ValueError line that says where the valid names are, never a traceback."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise ValueError(f"no config file {path!r}; {_config_files()}")
    try:
        module_spec = importlib.util.spec_from_file_location("_onona_config", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - any error of the file's own code
        raise ValueError(f"{path} fails to load ({_first_line(err)}); fix it or choose another "
                         f"({_config_files()})") from None
    if not callable(getattr(module, "get_config", None)):
        raise ValueError(f"{path} defines no get_config(); {_config_files()}")
    doc = (module.__doc__ or "").strip().splitlines()
    names = f"{path}'s get_config defines the names" + (f" ({doc[0].rstrip('.')})" if doc else "")
    try:
        cfg = module.get_config(arg) if arg else module.get_config()
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"{_first_line(err)}; {names}") from None
    if not isinstance(cfg, ml_collections.ConfigDict):
        raise ValueError(f"{path}'s get_config({arg!r}) returned {type(cfg).__name__}, not a ConfigDict")
    return cfg
