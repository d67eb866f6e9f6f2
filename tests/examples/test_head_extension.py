"""A head added from outside the package, the worked example of docs/extending.md ("Adding a head").

`TripletHead` ("triplet"): three tables A, B, C; the body reads their mean M = (A+B+C)/3; the
output mixes softmax(hAᵀ), softmax(hBᵀ), softmax(hCᵀ) with weights softmax(Gᵀ rmsnorm(M[x]))
that depend on the input token x alone (G [d, 3]). It is written here, registered with
`heads.register`, and nothing in the package names it: training, gate statistics, evaluation,
upcycling, folded serving with exact one-projection sampling over three tables, and the HF
export (loaded with transformers' AutoModelForCausalLM) read its declarations. Each result is
held to an independent float64 computation or to the unfolded model.
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from conftest import tiny_config  # noqa: E402
from onona_jax import config, heads  # noqa: E402
from onona_jax import models as model_lib  # noqa: E402
from onona_jax import train as trainer  # noqa: E402
from onona_jax.analysis import gate as gate_analysis  # noqa: E402
from onona_jax.checkpoint import restore_params  # noqa: E402
from onona_jax.data import pipeline  # noqa: E402
from onona_jax.eval import validation  # noqa: E402
from onona_jax.params import param  # noqa: E402
from onona_jax.serve import hf_format  # noqa: E402
from onona_jax.serve import server as serving  # noqa: E402
from onona_jax.tokenizer import EOT  # noqa: E402


class TripletHead(heads.Head):
    """Three tables, the body reads their mean, a softmax gate over three per input token."""

    tables = ("A", "B", "C")
    gate_reads = ("M", "M = (A+B+C)/3")

    def __init__(self, cfg):
        super().__init__(cfg)
        V, d = cfg.vocab_size, cfg.d_model
        self.A = param((V, d), ("vocab", "embed"), init_name="tables/A")
        self.B = param((V, d), ("vocab", "embed"), init_name="tables/B")
        self.C = param((V, d), ("vocab", "embed"), init_name="tables/C")
        self.gate = param((d, 3), ("embed", None))

    @classmethod
    def output_projections(cls, cfg):
        return 3

    @classmethod
    def upcycle(cls, init_params, E):  # A = B = C = E: every gate value gives the Standard model
        return cls.fill_tables(init_params, E, ("A", "B", "C"))

    def _tables(self):
        return self.A[...], self.B[...], self.C[...]

    def _log_weights(self, rows):  # [..., 3]
        return jax.nn.log_softmax(heads.rms_normalize(rows) @ self.gate[...], axis=-1)

    def embed(self, tokens):
        A, B, C = self._tables()
        return (jnp.take(A, tokens, axis=0) + jnp.take(B, tokens, axis=0) + jnp.take(C, tokens, axis=0)) / 3

    def mixture(self, h, x0):
        return heads.Mixture(h, self._tables(), self._log_weights(x0))

    def fold(self):
        A, B, C = self._tables()
        M = (A + B + C) / 3  # row for row as `embed` forms it
        return heads.Fold(M, (A, B, C), self._log_weights(M))

    def gate_probs(self, tokens):
        return jnp.exp(self._log_weights(self.embed(tokens)))

    def gate_stats(self, tokens):
        w = self.gate_probs(tokens).reshape(-1, 3)
        return {"gate_mean": jnp.mean(w, axis=0), "gate_sq": jnp.mean(jnp.square(w), axis=0)}


@pytest.fixture(scope="module", autouse=True)
def triplet():
    heads.register("triplet", TripletHead)
    yield
    heads.HEADS.pop("triplet")


def triplet_config(data_dir, **train):
    cfg = tiny_config(data_dir, head="twin", **train)
    cfg.model.head = "triplet"
    return config.validate(cfg)


# ----------------------------------------------------------------------------- float64 reference


def _f64(x):
    return np.asarray(x, np.float64)


def _log_softmax(z, axis=-1):
    z = z - z.max(axis=axis, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=axis, keepdims=True))


def reference_log_weights(head, tokens):
    """log softmax(Gᵀ rmsnorm(M[x])) [..., 3], float64 from the parameters."""
    M = (_f64(head["A"]) + _f64(head["B"]) + _f64(head["C"]))[tokens] / 3
    rows = M / np.sqrt(np.mean(M ** 2, axis=-1, keepdims=True) + heads.GATE_EPS)
    return _log_softmax(rows @ _f64(head["gate"]))


def reference_log_probs(head, h, tokens):
    """log Σ_k w_k[x] softmax(h T_kᵀ) [..., V], float64."""
    parts = np.stack([_log_softmax(_f64(h) @ _f64(head[t]).T) for t in "ABC"], axis=-2)
    z = reference_log_weights(head, tokens)[..., None] + parts
    top = z.max(axis=-2, keepdims=True)
    return (top + np.log(np.exp(z - top).sum(axis=-2, keepdims=True)))[..., 0, :]


def _noisy(params, seed=0, scale=0.1):
    """N(0, scale²) added to every leaf: logits and gate of order one, so a wrong table shows."""
    r = np.random.default_rng(seed)
    return jax.tree.map(lambda x: np.asarray(x, np.float32) + np.float32(scale) * r.standard_normal(x.shape,
                                                                                                      np.float32),
                        params)


# ----------------------------------------------------------------------------- registration


def test_register_refuses_a_non_head_and_a_taken_name():
    with pytest.raises(TypeError, match="subclass of heads.Head"):
        heads.register("not_a_head", dict)
    with pytest.raises(ValueError, match="'twin' is registered already"):
        heads.register("twin", TripletHead)
    assert heads.head_class("triplet") is TripletHead and heads.register("triplet", TripletHead) is TripletHead


# ----------------------------------------------------------------------------- training


@pytest.mark.slow  # suite-time margin (cover: test_triplet_evaluates_to_a_direct_computation; the step: test_train)
def test_triplet_trains_with_its_loss_and_gate_statistics(tiny_data):
    """Step 1's loss and gate statistics equal a float64 computation from the initial
    parameters and the first batch; five steps later the loss has fallen."""
    cfg = triplet_config(tiny_data)
    run = trainer.setup(cfg)
    state = trainer.init_state(run, cfg.seed)
    params0 = jax.device_get(state["params"])
    step = trainer.make_train_step(run)
    batches = pipeline.train_batches(cfg.data.dir, cfg.data.seq_len, cfg.train.global_batch)
    first = next(batches)
    losses, metrics = [], []
    for batch in [first] + [next(batches) for _ in range(5)]:
        state, m = step(state, trainer.global_batch(run, batch))
        m = jax.device_get(m)
        losses.append(float(m["loss"]))
        metrics.append(m)
    assert losses[-1] < losses[0] - 0.05, losses

    inputs, targets = first[:, :-1], first[:, 1:]
    h, _ = model_lib.bind(run.graphdef, params0).hidden(jnp.asarray(inputs))
    lp = reference_log_probs(params0["head"], np.asarray(h), inputs)
    want = -np.mean(np.take_along_axis(lp, targets[..., None], -1))
    np.testing.assert_allclose(losses[0], want, rtol=2e-5)

    w = np.exp(reference_log_weights(params0["head"], inputs)).reshape(-1, 3)
    for k in range(3):
        np.testing.assert_allclose(metrics[0][f"gate_mean_{k}"], w[:, k].mean(), rtol=0, atol=1e-6)
        np.testing.assert_allclose(metrics[0][f"gate_std_{k}"], w[:, k].std(), rtol=0, atol=1e-5)
    assert "gate_mean" not in metrics[0] and "gate_sq" not in metrics[0]


@pytest.fixture(scope="module")
def triplet_run(tiny_data, tmp_path_factory):
    """A trained triplet run (4 steps, validated every 2)."""
    cfg = triplet_config(tiny_data, steps=4, eval_every=2)
    cfg.mesh.data = 8
    workdir = str(tmp_path_factory.mktemp("triplet") / "run")
    trainer.train(cfg, workdir, progress=False)
    return workdir


def test_triplet_evaluates_to_a_direct_computation(triplet_run):
    """eval's validation loss (the checkpoint on its mesh, the fixed windows) is the float64
    mixture's mean NLL over the same windows; the head has no one-table ablations."""
    result = validation.validation(triplet_run, mesh=(8, 1, 1))
    assert set(result) == {"config", "step", "windows", "val_loss", "val_bits_per_byte", "val_bytes"}
    params, _, cfg, _ = restore_params(triplet_run, mesh=(8, 1, 1))
    params = jax.device_get(params)
    windows = pipeline.validation_windows(cfg.data.dir, cfg.data.seq_len, cfg.eval.windows, cfg.eval.seed)
    graphdef, _ = model_lib.abstract(cfg.model)
    h, _ = model_lib.bind(graphdef, params).hidden(jnp.asarray(windows[:, :-1]))
    lp = reference_log_probs(params["head"], np.asarray(h), windows[:, :-1])
    want = -np.mean(np.take_along_axis(lp, windows[:, 1:, None], -1))
    np.testing.assert_allclose(result["val_loss"], want, rtol=2e-5)


def test_gate_analysis_names_a_three_way_gate(triplet_run):
    params, _, cfg, _ = restore_params(triplet_run, mesh=(8, 1, 1))
    assert gate_analysis.gated_heads()["triplet"] == ("M", "M = (A+B+C)/3")
    with pytest.raises(ValueError, match="gate over two tables .*'triplet' mixes 3"):
        gate_analysis.gate_of(params, cfg.model)


# ----------------------------------------------------------------------------- upcycling


def test_upcycle_fills_every_table_and_refuses_one_left_out(tiny_data):
    """`TripletHead.upcycle` sets A = B = C = E and keeps the gate; a head that fills only A and
    B is refused before any checkpoint is read, naming C."""
    init_params = {"A": np.zeros((4, 2), np.float32), "B": np.ones((4, 2), np.float32),
             "C": np.ones((4, 2), np.float32), "gate": np.full((2, 3), 7.0, np.float32)}
    E = np.arange(8, dtype=np.float32).reshape(4, 2)
    out = TripletHead.upcycle(init_params, jnp.asarray(E))
    for t in "ABC":
        np.testing.assert_array_equal(np.asarray(out[t]), E)
    np.testing.assert_array_equal(out["gate"], init_params["gate"])

    class Forgetful(TripletHead):
        @classmethod
        def upcycle(cls, init_params, E):
            return cls.fill_tables(init_params, E, ("A", "B"))

    heads.register("forgetful", Forgetful)
    try:
        cfg = triplet_config(tiny_data)
        cfg.model.head = "forgetful"
        run = trainer.setup(config.validate(cfg))
        with pytest.raises(ValueError, match=r"Forgetful.upcycle leaves table\(s\) C at random init"):
            trainer.upcycle(run, None, "/nonexistent/run")
    finally:
        heads.HEADS.pop("forgetful")


# ----------------------------------------------------------------------------- serving


@pytest.mark.slow  # suite-time margin (cover: test_serving's twin_server tests)
def test_folded_server_scores_and_generates_as_the_model(triplet_run):
    """Server.from_workdir folds the head (`TripletHead.fold`): its log-probabilities are the
    unfolded model's (1e-5), its gate lookup [V, 3] the head's gate of every token (1e-6),
    greedy decoding the argmax of the full forward; one-projection sampling runs per seed."""
    server = serving.Server.from_workdir(triplet_run)
    assert server.gated and server.gate.shape == (server.vocab_size, 3)
    params, _, cfg, _ = restore_params(triplet_run, mesh=(8, 1, 1))
    graphdef, _ = model_lib.abstract(cfg.model)
    net = model_lib.bind(graphdef, jax.device_get(params))
    np.testing.assert_allclose(server.gate, np.asarray(net.head.gate_probs(jnp.arange(server.vocab_size))),
                               rtol=0, atol=1e-6)
    tokens = np.random.default_rng(0).integers(0, 50257, (2, 12))
    np.testing.assert_allclose(server.log_probs(tokens), np.asarray(net(tokens)), rtol=0, atol=1e-5)

    prompt = [EOT, 464, 3290]
    (greedy,) = server.generate([prompt], 4, greedy=True)
    seq = list(prompt)
    for _ in range(4):
        seq.append(int(np.argmax(np.asarray(net(np.asarray([seq])))[0, -1])))
    assert greedy == seq[len(prompt):]
    a = server.generate([prompt, [40]], 5, one_projection=True, seed=3)
    assert a == server.generate([prompt, [40]], 5, one_projection=True, seed=3)
    assert all(len(row) == 5 and all(0 <= t < server.vocab_size for t in row) for row in a)


def _three_tables(V=20, d=8, seed=0):
    r = np.random.default_rng(seed)
    return tuple(jnp.asarray(0.5 * r.standard_normal((V, d)), jnp.float32) for _ in range(3))


def test_one_projection_sampling_over_three_tables_is_exact():
    """200,000 draws of `sample_mixture` (a table k ~ w, then a token from softmax(h T_kᵀ)),
    max_branches 4 so rows are cut into slabs, fit Σ_k w_k softmax(h T_kᵀ) (chi-square
    p > 0.001); the pre-softmax mixture softmax(Σ_k w_k T_k h) is rejected (p < 0.001)."""
    from scipy import stats

    tables = _three_tables()
    h = jnp.asarray(np.random.default_rng(1).standard_normal(8), jnp.float32)
    w = np.array([0.5, 0.3, 0.2])
    mixture = sum(wk * np.asarray(jax.nn.softmax(T @ h), np.float64) for wk, T in zip(w, tables))
    n_calls, N = 10, 20_000
    hs = jnp.broadcast_to(h, (N, 8))
    lw = jnp.broadcast_to(jnp.log(jnp.asarray(w, jnp.float32)), (N, 3))
    one = jax.jit(lambda k: serving.sample_mixture(k, hs, tables, lw, max_branches=4))
    draws = np.concatenate([np.asarray(one(jax.random.key(i))) for i in range(n_calls)])

    def p_value(draws, p):
        counts = np.bincount(draws, minlength=p.size)
        return stats.chisquare(counts, p / p.sum() * counts.sum()).pvalue

    assert p_value(draws, mixture) > 1e-3
    pre = np.asarray(jax.nn.softmax(sum(wk * T for wk, T in zip(w, tables)) @ h), np.float64)
    assert np.abs(pre - mixture).max() > 0.01
    pre_draws = np.asarray(jax.random.categorical(jax.random.key(5), jnp.broadcast_to(jnp.log(pre), (n_calls * N, 20))))
    assert p_value(pre_draws, mixture) < 1e-3


@pytest.mark.parametrize("n,max_branches", [(1, 64), (7, 64), (13, 4)])
def test_component_logits_projects_each_row_once_but_at_slab_edges(n, max_branches, monkeypatch):
    """Row r of `component_logits` is h_r T_{c_r}ᵀ (exact values); the projections it runs
    (counted as they execute) cover n rows, plus at most (K − 1) slabs of ⌈n/max_branches⌉
    rows where the sorted components change inside a slab; one row: one projection."""
    tables = _three_tables()
    r = np.random.default_rng(n)
    h = jnp.asarray(r.standard_normal((n, 8)), jnp.float32)
    rows = []
    plain = heads.logits

    def counted(x, T):
        jax.debug.callback(lambda m: rows.append(int(m)), x.shape[0])
        return plain(x, T)

    monkeypatch.setattr(serving.heads_lib, "logits", counted)
    S = -(-n // min(n, max_branches))
    for c in (np.zeros(n, np.int32), np.full(n, 2, np.int32), r.integers(0, 3, n).astype(np.int32)):
        rows.clear()
        got = jax.block_until_ready(serving.component_logits(h, tables, jnp.asarray(c), max_branches))
        want = np.stack([np.asarray(h[i] @ tables[c[i]].T) for i in range(n)])
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5)
        slabs = -(-n // S)
        assert slabs * S <= sum(rows) <= slabs * S + (len(set(c.tolist())) - 1) * S, (c, rows)
        if len(set(c.tolist())) == 1:
            assert sum(rows) == slabs * S  # every slab one projection
    if n == 1:
        assert rows == [1]


# ----------------------------------------------------------------------------- HF export


@pytest.mark.slow  # suite-time margin (cover: test_hf_export's twin and standard exports)
def test_triplet_exports_to_transformers(tiny_data, tmp_path):
    """hf_format.export writes the fold the head declares: config.json names the three
    output tables and the gate lookup; AutoModelForCausalLM (trust_remote_code, the copied
    modeling file alone) gives the JAX model's log-probabilities (1e-4) and greedy
    continuation, and the folder reads back bit-exactly."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = triplet_config(tiny_data)
    params = _noisy(model_lib.init(cfg.model, 0)[1])
    out = str(tmp_path / "hf")
    kind, files = hf_format.export(params, cfg, out, tokenizer=False)
    assert kind == "onona" and set(files) <= set(hf_format.EXPORT_FILES)
    hf_cfg = json.load(open(os.path.join(out, "config.json")))
    assert hf_cfg["head"] == "triplet" and hf_cfg["head_rule"] == "mixture"
    assert hf_cfg["head_outputs"] == ["twin.A", "twin.B", "head.C"]
    assert hf_cfg["head_log_weights"] == "head.log_weights"
    assert hf_cfg["head_tensors"]["head.log_weights"] == [cfg.model.vocab_size, 3]
    assert hf_cfg["head_tensors"]["head.gate"] == [cfg.model.d_model, 3]

    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    tokens = np.random.default_rng(1).integers(0, 50257, (2, 21))
    ours = np.asarray(model_lib.bind(model_lib.abstract(cfg.model)[0], params)(tokens))
    with torch.no_grad():
        theirs = torch.log_softmax(hf(torch.from_numpy(tokens)).logits.float(), -1).numpy()
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4)

    prompt = [EOT, 464, 3290]
    want = serving.Server(cfg, params).generate([prompt], 6, greedy=True)[0]
    with torch.no_grad():
        ids = torch.tensor([prompt])
        got = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                          eos_token_id=None, pad_token_id=EOT)
    assert got[0, len(prompt):].tolist() == want

    back = hf_format.from_hf({k: v.numpy() for k, v in hf.state_dict().items()}, cfg.model)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
