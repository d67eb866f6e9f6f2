"""Gate analysis, loss curves and the PyTorch exports, checked against direct computations
from a trained tiny model's checkpoint (fp32 throughout)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import REPO, tiny_config
from onona_jax import config, tokenizer
from onona_jax.checkpoint import restore_params
from onona_jax.serve import export
from onona_jax import models as model
from onona_jax import train as trainer
from onona_jax.analysis import curves, gate

N = tokenizer.TOKENIZER_VOCAB
EPS = float(np.finfo(np.float32).eps)


def _train(cfg, workdir):
    cfg.mesh.data = 8
    trainer.train(cfg, workdir, progress=False)
    return workdir


@pytest.fixture(scope="module")
def twin_run(tiny_data, tmp_path_factory):
    cfg = tiny_config(tiny_data, head="twin", steps=20, eval_every=5)
    return _train(cfg, str(tmp_path_factory.mktemp("analysis") / "twin"))


@pytest.fixture(scope="module")
def standard_run(tiny_data, tmp_path_factory):
    cfg = tiny_config(tiny_data, head="standard", steps=4, eval_every=2)
    return _train(cfg, str(tmp_path_factory.mktemp("analysis") / "standard"))


def _restore(workdir):
    """(graphdef, host params, step, cfg) of the run's latest checkpoint."""
    params, step, cfg, _ = restore_params(workdir, mesh=(8, 1, 1))
    graphdef, _ = model.abstract(cfg.model)
    return graphdef, jax.tree.map(lambda x: np.asarray(x, np.float32), params), step, cfg


def _train_counts(data_dir):
    manifest = json.load(open(os.path.join(data_dir, "manifest.json")))
    tokens = np.concatenate([np.fromfile(os.path.join(data_dir, s["file"]), np.uint16)
                             for s in manifest["splits"]["train"]["shards"]])
    return np.bincount(tokens, minlength=N)[:N].astype(np.int64)


# ----------------------------------------------------------------------------- gate


def test_gate_report_matches_a_direct_computation(twin_run, tiny_data, tmp_path):
    out = tmp_path / "analysis"
    assert gate.main([f"--workdir={twin_run}", f"--output_dir={out}", "--top=12", "--min_count=5"]) == 0
    _, params, step, _ = _restore(twin_run)
    report = json.load(open(out / f"gate_step_{step}.json"))
    assert (out / f"gate_step_{step}.md").stat().st_size > 0
    assert (out / f"gate_step_{step}.png").stat().st_size > 0

    # g over the real tokens, in float64 straight from the tables.
    A = params["head"]["A"].astype(np.float64)
    B = params["head"]["B"].astype(np.float64)
    w = params["head"]["gate"].astype(np.float64)
    M = ((A + B) / 2)[:N]
    z = (M / np.sqrt(np.mean(M**2, axis=-1, keepdims=True) + EPS)) @ w
    g = 1.0 / (1.0 + np.exp(-z))
    assert g.std() > 1e-4  # the gate has moved off a constant: the lists below mean something
    counts = _train_counts(tiny_data)
    tol = dict(rel=0, abs=2e-6)

    assert report["step"] == step and report["head"] == "twin" and report["vocab_tokens"] == N
    assert report["occurrence_source"]["split"] == "train"
    assert report["occurrence_source"]["tokens"] == counts.sum()
    v = report["vocabulary"]
    assert v["n"] == N
    assert v["mean"] == pytest.approx(g.mean(), **tol)
    assert v["std"] == pytest.approx(g.std(), **tol)
    assert v["frac_above_half"] == pytest.approx(np.mean(g > 0.5), abs=1e-4)
    for q, value in v["quantiles"].items():
        assert value == pytest.approx(np.quantile(g, float(q)), **tol), q

    o = report["occurrences"]
    mean = (counts * g).sum() / counts.sum()
    assert o["n"] == counts.sum() and o["distinct"] == (counts > 0).sum()
    assert o["mean"] == pytest.approx(mean, **tol)
    assert o["std"] == pytest.approx(np.sqrt((counts * (g - mean) ** 2).sum() / counts.sum()), **tol)
    repeated = np.repeat(g, counts)
    for q, value in o["quantiles"].items():
        assert value == pytest.approx(np.quantile(repeated, float(q), method="inverted_cdf"), **tol), q

    # Top lists: the reported g are the k largest / smallest, each the gate of its own token.
    def check(rows, largest, mask=None):
        pool = g if mask is None else g[mask]
        expect = np.sort(pool)[::-1][:12] if largest else np.sort(pool)[:12]
        np.testing.assert_allclose([r["g"] for r in rows], expect, rtol=0, atol=2e-6)
        for r in rows:
            assert r["g"] == pytest.approx(g[r["id"]], **tol)
            assert r["count"] == counts[r["id"]]
            assert r["text"] == tokenizer.get_tokenizer().decode_single_token_bytes(r["id"]).decode(
                "utf-8", errors="replace")
            assert mask is None or mask[r["id"]]

    check(report["top_a"], True)
    check(report["top_b"], False)
    frequent = counts >= 5
    assert report["frequent_tokens"] == frequent.sum()
    check(report["top_a_frequent"], True, frequent)
    check(report["top_b_frequent"], False, frequent)

    # Per-class statistics from the labels and the direct g and counts.
    labels = np.array([gate.classify(i, b) for i, b in enumerate(gate.token_bytes())])
    assert sum(c["n_tokens"] for c in report["classes"].values()) == N
    for name, c in report["classes"].items():
        mask = labels == name
        assert c["n_tokens"] == mask.sum()
        assert c["mean"] == pytest.approx(g[mask].mean(), **tol), name
        assert c["occurrences"] == counts[mask].sum()
        if counts[mask].sum():
            occ_mean = (counts[mask] * g[mask]).sum() / counts[mask].sum()
            assert c["occurrence_mean"] == pytest.approx(occ_mean, **tol), name
    assert report["classes"]["punctuation"]["occurrences"] > 0
    assert report["classes"]["word_initial"]["occurrences"] > 0


def test_token_classes():
    enc = tokenizer.get_tokenizer()

    def cls(text):
        i = enc.encode_single_token(text.encode())
        return gate.classify(i, enc.decode_single_token_bytes(i))

    assert gate.classify(tokenizer.EOT, b"<|endoftext|>") == "special"
    assert cls(" the") == "word_initial" and cls(" The") == "word_initial"
    assert cls("the") == "continuation" and cls("ing") == "continuation"
    assert cls(".") == "punctuation" and cls(" (") == "punctuation" and cls(",\"") == "punctuation"
    assert cls("123") == "digits" and cls(" 2021") == "digits"
    assert cls(" ") == "whitespace" and cls("\n\n") == "whitespace"
    assert cls("'s") == "other"
    assert gate.classify(447, enc.decode_single_token_bytes(447)) == "partial_utf8"  # b'\xe2\x80'


def test_weighted_distribution_definitions():
    g = np.array([0.1, 0.9, 0.5, 0.7])
    w = np.array([3, 0, 1, 1])
    d = gate.distribution(g, w)
    assert d["n"] == 5 and d["distinct"] == 3 and d["max"] == 0.7
    assert d["mean"] == pytest.approx((0.3 + 0.5 + 0.7) / 5)
    assert d["frac_above_half"] == pytest.approx(1 / 5)
    assert d["quantiles"]["0.5"] == 0.1 and d["quantiles"]["0.75"] == 0.5 and d["quantiles"]["1.0"] == 0.7
    assert list(gate.top_tokens(np.array([0.2, 0.8, 0.8, 0.1]), 2, True)) == [1, 2]  # ties: lower id
    assert list(gate.top_tokens(np.array([0.2, 0.8, 0.8, 0.1]), 2, False)) == [3, 0]


def test_gate_analysis_refuses_an_ungated_head(standard_run, capsys):
    with pytest.raises(ValueError, match="gated head.*'standard'"):
        gate.analyze(standard_run)
    assert gate.main([f"--workdir={standard_run}"]) == 2
    assert "has no gate" in capsys.readouterr().err


# ----------------------------------------------------------------------------- curves


def _last_rows(workdir, metric="val_loss"):
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    return [r for r in rows if metric in r]


def test_curves_final_values_are_the_last_validation_rows(twin_run, standard_run, tmp_path, capsys):
    runs = curves.collect([twin_run, standard_run])
    assert [r["label"] for r in runs] == ["dense-tiny-twin", "dense-tiny-standard"]
    for r, d in zip(runs, (twin_run, standard_run)):
        rows = _last_rows(d)
        assert r["final"] == rows[-1]["val_loss"] and r["final_step"] == rows[-1]["step"]
        assert r["steps"] == [row["step"] for row in rows]
        assert r["values"] == [row["val_loss"] for row in rows]
    assert runs[0]["steps"] == [5, 10, 15, 20] and runs[1]["steps"] == [2, 4]

    png = tmp_path / "curves.png"
    assert curves.main([twin_run, standard_run, f"--output={png}"]) == 0
    assert png.stat().st_size > 0
    printed = capsys.readouterr().out
    assert f"{runs[0]['final']:.6f}" in printed and f"{runs[1]['final']:.6f}" in printed


def test_curves_keep_the_last_row_of_a_step_and_name_missing_metrics(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    rows = [{"step": 5, "loss": 3.0}, {"step": 10, "val_loss": 2.5}, {"step": 15, "val_loss": 2.4},
            {"step": 10, "val_loss": 2.45},  # resumed from step 5: step 10 logged again
            {"step": 15, "val_loss": 2.3}, {"step": 20, "loss": 2.0}]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert curves.load_curve(str(d)) == ([10, 15], [2.45, 2.3])
    assert curves.run_label(str(d)) == "run"  # no config.json: the directory's name
    with pytest.raises(ValueError, match="no rows with 'val_loss_a_only'"):
        curves.load_curve(str(d), "val_loss_a_only")
    with pytest.raises(ValueError, match="does not exist"):
        curves.load_curve(str(tmp_path / "nowhere"))


# ----------------------------------------------------------------------------- export


def _tokens(seed=0, T=40):
    return np.random.default_rng(seed).integers(0, N, (2, T))


def test_standard_export_loads_in_transformers_and_matches(standard_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = str(tmp_path / "hf")
    summary = export.export(standard_run, out)
    assert summary["kind"] == "hf-qwen3"
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert os.path.isfile(os.path.join(out, name)), name

    graphdef, params, _, cfg = _restore(standard_run)
    tokens = _tokens()
    ours = np.asarray(model.bind(graphdef, jax.tree.map(jnp.asarray, params))(tokens))

    hf, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # tied
    with torch.no_grad():
        theirs = torch.log_softmax(hf.eval()(torch.from_numpy(tokens)).logits.float(), -1).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)

    tok = AutoTokenizer.from_pretrained(out)
    text = "It is a truth universally acknowledged, that a single man in possession of a good fortune,\n\n  12,500 pounds!"
    assert tok.encode(text, add_special_tokens=False) == tokenizer.encode(text)
    assert tok.eos_token_id == tokenizer.EOT


def test_twin_export_serves_the_same_log_probs(twin_run, tmp_path):
    from reference.torch_ref import TwinServing

    out = str(tmp_path / "twin")
    summary = export.export(twin_run, out, tokenizer=False)
    assert summary["kind"] == "hf-onona"
    hf_config = json.load(open(os.path.join(out, "config.json")))  # not a Qwen3ForCausalLM
    assert (hf_config["model_type"], hf_config["family"], hf_config["head"]) == ("onona", "dense", "twin")

    graphdef, params, _, cfg = _restore(twin_run)
    tokens = _tokens(1)
    bound = model.bind(graphdef, jax.tree.map(jnp.asarray, params))
    ours = np.asarray(bound(tokens))

    served = TwinServing.from_export(out)
    with torch.no_grad():
        theirs = served(torch.from_numpy(tokens)).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)

    # The folded tensors: M, and g = the model's own gate of every token.
    A, B = params["head"]["A"], params["head"]["B"]
    np.testing.assert_array_equal(served.M.numpy(), (A + B) * np.float32(0.5))
    g_model = np.asarray(bound.head.gate_probs(jnp.arange(cfg.model.vocab_size)))
    np.testing.assert_allclose(served.g.numpy(), g_model, rtol=0, atol=1e-6)
    np.testing.assert_allclose(torch.sigmoid(served.gate_logit).numpy(), served.g.numpy(), atol=1e-7)

    # score(): the log-probability of each next token.
    scores = served.score(torch.from_numpy(tokens)).numpy()
    np.testing.assert_allclose(scores, np.take_along_axis(ours[:, :-1], tokens[:, 1:, None], -1)[..., 0],
                               rtol=0, atol=1e-4)
    text = served.score_text("Emma was handsome.")
    assert text["ids"] == tokenizer.encode("Emma was handsome.") and np.isfinite(text["total"])
    nxt = served.sample_next(torch.from_numpy(tokens), torch.Generator().manual_seed(0))
    assert nxt.shape == (2,) and ((0 <= nxt) & (nxt < cfg.model.vocab_size)).all()


def test_export_covers_every_family_and_head():
    paper = os.path.join(REPO, "configs", "paper.py")
    for arch in config.ARCHS:
        for head in config.HEADS:
            export.check_exportable(config.load(f"{paper}:{arch}-tiny-{head}").model)
    m = config.load(f"{paper}:dense-tiny-twin").model
    m.head = "softmax_bottleneck"  # a head this version does not know
    with pytest.raises(ValueError, match="export supports families dense, moe, gdn, attnres with any head"):
        export.check_exportable(m)
