"""Downstream tasks (onona_jax.eval.tasks) and the lm-evaluation-harness model (onona_jax.eval.lm_eval_model).

A tiny twin model trained for a few steps scores the fixtures in tests/fixtures/ (made up,
in each task's public format). Every task's metrics are checked against a computation by
hand from the model's log-probabilities, and against lm-evaluation-harness's own
`simple_evaluate` of the same model on the same fixtures (tests/fixtures/lm_eval_tasks/).
"""

import importlib.util
import inspect
import json
import math
import os
import re

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing is downloaded
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from conftest import REPO, tiny_config  # noqa: E402
from onona_jax.checkpoint import restore_params
from onona_jax.eval import validation
from onona_jax.eval import tasks
from onona_jax import train as trainer
from onona_jax import models as model_lib  # noqa: E402
from onona_jax.eval.tasks import data as data_lib  # noqa: E402
from onona_jax.eval.tasks import lambada, mmlu, multiple_choice, wikitext  # noqa: E402
from onona_jax.tokenizer import EOT, encode, load as load_tokenizer  # noqa: E402

try:  # the harness-independent tests run without lm_eval; the comparisons with it need it
    import lm_eval
except ImportError:
    lm_eval = None
needs_harness = pytest.mark.skipif(lm_eval is None, reason="lm-evaluation-harness not installed (pip install -e '.[test]')")

FIX = os.path.join(REPO, "tests", "fixtures")
HARNESS_YAMLS = os.path.join(FIX, "lm_eval_tasks")
L = 64  # max_length in these tests: several rolling windows per fixture document, MMLU truncated
MC_TASKS = ["hellaswag", "arc_easy", "arc_challenge", "piqa", "boolq", "sciq"]
PATHS = {
    "wikitext2": os.path.join(FIX, "wikitext", "wiki.test.raw"),
    "lambada": os.path.join(FIX, "lambada_openai.jsonl"),
    **{t: os.path.join(FIX, f"{t}.jsonl") for t in MC_TASKS},
    "mmlu": os.path.join(FIX, "mmlu", "data"),
}
HARNESS_NAMES = {"wikitext2": "fixture_wikitext", "lambada": "fixture_lambada_openai",
                 **{t: f"fixture_{t}" for t in MC_TASKS}, "mmlu": "fixture_mmlu"}


def one_device():
    return jax.devices()[:1]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def trained(tiny_data, tmp_path_factory):
    """A dense-tiny-twin trained for a few steps (so its log-probs are far from uniform)."""
    cfg = tiny_config(tiny_data, head="twin", steps=12, micro_batch=0, warmup_steps=2)
    cfg.mesh.data = 1
    workdir = str(tmp_path_factory.mktemp("tasks_run") / "twin")
    trainer.train(cfg, workdir, devices=one_device(), progress=False)
    return workdir


@pytest.fixture(scope="session")
def scorer(trained):
    return tasks.Scorer.from_workdir(trained, mesh=(1, 1, 1), batch_size=8, max_length=L)


@pytest.fixture(scope="session")
def ours(scorer):
    return tasks.evaluate(scorer, list(PATHS), PATHS, shots=5)


@pytest.fixture(scope="session")
def hand(trained):
    """Log-probabilities straight from `Model.__call__` (the training graphdef, no Scorer):
    hand(pairs) -> [(log p of each target, each target == argmax)] for (inputs, targets)."""
    params, _, cfg, _ = restore_params(trained, mesh=(1, 1, 1), devices=one_device())
    graphdef, _ = model_lib.abstract(cfg.model)
    fn = jax.jit(lambda p, t: model_lib.bind(graphdef, p)(t))

    def score(pairs):
        out = []
        for s in range(0, len(pairs), 8):
            chunk = pairs[s:s + 8]
            toks = np.zeros((8, L), np.int32)
            for r, (inp, _) in enumerate(chunk):
                assert len(inp) <= L
                toks[r, :len(inp)] = inp
            lp = np.asarray(fn(params, toks))
            for r, (inp, tgt) in enumerate(chunk):
                n = len(inp)
                rows = lp[r, n - len(tgt):n]
                out.append((rows[np.arange(len(tgt)), tgt].astype(np.float64), rows.argmax(-1) == np.asarray(tgt)))
        return out

    return score


def hand_requests(hand, pairs):
    """(ll, greedy) of (context string, continuation string) pairs, tokenised by hand:
    the continuation's tokens are those of context + continuation after the context's own."""
    reqs = []
    for ctx, cont in pairs:
        assert ctx and not ctx[-1].isspace()  # the fixtures' contexts: no whitespace to move
        c = encode(ctx)
        whole = encode(ctx + cont)
        assert whole[:len(c)] == c
        seq = whole[-(L + 1):]  # left truncation to L inputs
        reqs.append((seq[:-1], whole[len(c):]))
    return [(float(lp.sum()), bool(g.all())) for lp, g in hand(reqs)]


@pytest.fixture(scope="session")
def harness(scorer):
    """lm-evaluation-harness's simple_evaluate of our model on every fixture task."""
    pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from onona_jax.eval.lm_eval_model import OnonaLM

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)  # the fixture YAMLs name their data relative to the repository root
        out = lm_eval.simple_evaluate(
            model=OnonaLM(scorer=scorer), tasks=list(HARNESS_NAMES.values()),
            task_manager=TaskManager(include_path=HARNESS_YAMLS, include_defaults=False),
            bootstrap_iters=0, log_samples=True)
    return out


# ----------------------------------------------------------------------------- windows, pairs


@needs_harness
@pytest.mark.parametrize("max_len,context_len", [(1, 1), (4, 1), (8, 1), (8, 3), (64, 1)])
def test_rolling_windows_equal_the_harness_and_score_every_token_once(max_len, context_len):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    rng = np.random.default_rng(0)
    for n in [0, 1, 2, max_len - 1, max_len, max_len + 1, 2 * max_len, 3 * max_len + 5, 200]:
        if n < 0:
            continue
        toks = [int(t) for t in rng.integers(0, 50000, size=n)]
        ours = tasks.rolling_windows(toks, max_len, EOT, context_len)
        ref = [make_disjoint_window(w) for w in get_rolling_token_windows(toks, EOT, max_len, context_len)]
        assert ours == [(list(a), list(b)) for a, b in ref]
        # every token scored exactly once, in order
        assert [t for _, cont in ours for t in cont] == toks
        done = 0
        for k, (ctx, cont) in enumerate(ours):
            inputs = (ctx + cont)[:-1]
            assert len(inputs) <= max_len and len(cont) >= 1
            if k == 0:  # the prefix token conditions the first token
                assert ctx == [EOT] and inputs == [EOT] + toks[:len(cont) - 1]
            else:  # the context is the tokens right before the window, filling max_len inputs
                assert inputs == toks[done + len(cont) - max_len - 1 + 0 : done + len(cont) - 1][-max_len:]
                assert len(inputs) == max_len
                assert ctx == toks[done - len(ctx):done]
                if len(cont) == max_len - context_len + 1:  # a full window reads context_len tokens before it
                    assert len(ctx) == context_len
            done += len(cont)


@needs_harness
def test_encode_pair_equals_the_harness():
    from onona_jax.eval.lm_eval_model import OnonaLM

    class _Stub:
        max_length, batch_size, tokenizer = L, 8, load_tokenizer()

    lm = OnonaLM(scorer=_Stub())
    cases = [("Question: why?\nAnswer:", " because"), ("The cat sat on the ", "mat"), ("a  ", " b"),
             ("", " hello"), ("", "<|endoftext|>x"), ("naïve café", " 東京"), ("x", "y")]
    for ctx, cont in cases:
        want = lm._encode_pair(ctx, cont) if ctx else None
        got = tasks.encode_pair(ctx, cont, encode, EOT)
        if ctx:
            assert got == tuple(want)
        else:
            assert got == ([EOT], encode(cont))


def test_scorer_batches_and_truncates_like_single_requests(scorer, hand):
    rng = np.random.default_rng(1)
    reqs = []
    for n_ctx, n_cont in [(1, 1), (5, 3), (30, 10), (70, 5), (200, 64), (63, 1), (2, 20), (10, 2), (40, 24)]:
        reqs.append(([int(t) for t in rng.integers(0, 50000, n_ctx)],
                     [int(t) for t in rng.integers(0, 50000, n_cont)]))
    got = scorer.loglikelihood_tokens(reqs)
    want = [(float(lp.sum()), bool(g.all())) for lp, g in
            hand([((c + x)[-(L + 1):][:-1], x) for c, x in reqs])]
    for (a, ga), (b, gb) in zip(got, want):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-4) and ga == gb
    with pytest.raises(ValueError, match="exceeds max_length"):
        scorer.loglikelihood_tokens([([1], list(range(L + 1)))])


def test_bucket_lengths():
    from onona_jax.eval.tasks.scoring import bucket_length

    assert [bucket_length(n, 1000) for n in (1, 16, 17, 300, 600, 1000)] == [16, 16, 32, 512, 1000, 1000]
    assert [bucket_length(n, 8) for n in (1, 8)] == [8, 8]


def test_moe_scores_with_the_evaluation_capacity():
    """An MoE scorer builds its model from moe.eval_config (capacity factor 4.0: nothing
    dropped, so padding cannot change a real token's score): batched scores equal the
    unpadded evaluation model's, one request at a time."""
    from flax import nnx

    from onona_jax import config
    from onona_jax.models import moe

    cfg = config.load(os.path.join(REPO, "configs/paper.py:moe-tiny-twin"))
    cfg.mesh.data = 1
    run = trainer.setup(cfg, one_device())
    params = trainer.init_state(run, 0)["params"]
    sc = tasks.Scorer.from_params(params, cfg, run.mesh, batch_size=4, max_length=32)
    factors = {m.capacity_factor for _, m in nnx.iter_graph(model_lib.bind(sc.graphdef, params))
               if isinstance(m, moe.MoE)}
    assert factors == {cfg.model.moe.eval_capacity_factor} == {4.0} and cfg.model.moe.capacity_factor < 4.0
    rng = np.random.default_rng(2)
    reqs = [([int(t) for t in rng.integers(0, 50000, n)], [int(t) for t in rng.integers(0, 50000, 3)])
            for n in (4, 12, 29)]
    got = sc.loglikelihood_tokens(reqs)
    graphdef, _ = model_lib.abstract(moe.eval_config(cfg.model))
    fn = jax.jit(lambda p, x, y: model_lib.bind(graphdef, p).target_log_probs(x, y))
    for (ctx, cont), (ll, _) in zip(reqs, got):
        toks = np.asarray([ctx + cont], np.int32)  # unpadded, alone
        want = fn(params, toks[:, :-1], toks[:, 1:])[0, -len(cont):]
        assert ll == pytest.approx(float(np.sum(want)), rel=1e-5)


# ----------------------------------------------------------------------------- formats


@needs_harness
def test_wikitext_formats_agree(tmp_path):
    raw_path = PATHS["wikitext2"]
    docs, _ = wikitext.load(raw_path)
    assert len(docs) == 3 and docs[0].startswith(" = Valdemar Brook = \n \n Valdemar")
    # the document-level export (the harness's dataset), as jsonl and parquet
    doc_level = os.path.join(FIX, "wikitext", "wikitext_document_level.jsonl")
    assert wikitext.load(doc_level)[0] == docs
    assert wikitext.load(os.path.dirname(raw_path))[0] == docs  # a directory holding wiki.test.raw
    # the HF wikitext-2-raw-v1 line format: one row per line with its newline, blank lines ""
    with open(raw_path, encoding="utf-8") as f:
        rows = [{"text": line if line.strip() else ""} for line in f]
    lines = tmp_path / "wikitext-2-raw-v1-test.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert wikitext.load(str(lines))[0] == docs
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"page": d} for d in docs]), tmp_path / "test.parquet")
    assert wikitext.load(str(tmp_path / "test.parquet"))[0] == docs
    # the harness's detokeniser and word count
    from lm_eval.tasks.wikitext import preprocess_wikitext as ref

    for d in docs:
        assert wikitext.detokenize(d) == ref.wikitext_detokenizer({"page": d})
        assert ref.process_results({"page": d}, [0.0])["word_perplexity"][1] == wikitext.count_words(d)


def test_multiple_choice_formats_agree():
    def same(task, a, b):
        ea, _ = multiple_choice.load(task, a)
        eb, _ = multiple_choice.load(task, b)
        assert ea == eb and len(ea) >= 3

    same("arc_easy", PATHS["arc_easy"], os.path.join(FIX, "arc_original", "ARC-Easy-Test.jsonl"))
    same("piqa", PATHS["piqa"], os.path.join(FIX, "piqa_original", "valid.jsonl"))
    same("boolq", PATHS["boolq"], os.path.join(FIX, "boolq_original", "dev.jsonl"))
    same("sciq", PATHS["sciq"], os.path.join(FIX, "sciq_original", "test.json"))
    _, files = multiple_choice.load("piqa", os.path.join(FIX, "piqa_original", "valid.jsonl"))
    assert [os.path.basename(f) for f in files] == ["valid.jsonl", "valid-labels.lst"]
    # ARC with numeric labels ("1".."4") picks the labelled choice
    ex, _ = multiple_choice.load("arc_challenge", PATHS["arc_challenge"])
    assert [e.gold for e in ex] == [0, 2, 1]


def test_mmlu_formats_agree_and_prompt():
    a, files = mmlu.load(PATHS["mmlu"])
    b, _ = mmlu.load(os.path.join(FIX, "mmlu_hf"))
    assert a == b and len(files) == 4
    assert sorted(a["test"]) == ["astronomy", "high_school_us_history"]
    items = mmlu.examples(a, shots=5)
    subject, ex = items[0]
    dev = a["dev"]["astronomy"]
    assert ex.context.startswith(
        "The following are multiple choice questions (with answers) about astronomy.\n\n"
        "What is the closest star to Earth?\nA. Sirius\nB. The Sun\nC. Polaris\nD. Vega\nAnswer: B\n\n")
    assert ex.context.count("\nAnswer:") == 6 and ex.context.endswith("D. Mercury\nAnswer:")
    # up to k shots: fewer dev questions than k gives them all
    a["dev"]["astronomy"] = dev[:3]
    assert mmlu.examples(a, shots=5)[0][1].context.count("\nAnswer:") == 4
    assert mmlu.examples(a, shots=0)[0][1].context.count("\nAnswer:") == 1


def test_bad_data_is_reported(tmp_path):
    bad = tmp_path / "lambada.jsonl"
    bad.write_text('{"passage": "no text field"}\n')
    with pytest.raises(ValueError, match="lacks field"):
        lambada.load(str(bad))
    with pytest.raises(ValueError, match="does not exist"):
        lambada.load(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="unknown task"):
        tasks.resolve_paths(["wikitext3"], {})
    with pytest.raises(ValueError, match="--task_data=hellaswag=PATH"):
        tasks.resolve_paths(["hellaswag"], {}, str(tmp_path))
    assert tasks.resolve_paths(["mmlu"], {}, os.path.join(FIX, "mmlu")) == {"mmlu": os.path.join(FIX, "mmlu", "data")}


@needs_harness
def test_fixture_task_yamls_follow_the_installed_harness():
    try:
        from lm_eval.tasks._yaml_loader import load_yaml
    except ImportError:  # older harness releases
        from lm_eval.utils import load_yaml_config as load_yaml

    root = os.path.join(os.path.dirname(lm_eval.__file__), "tasks")

    def same(a, b):
        if callable(a) or callable(b):
            return inspect.getsource(a) == inspect.getsource(b)
        return a == b

    keys = ["output_type", "doc_to_text", "doc_to_target", "doc_to_choice", "target_delimiter",
            "fewshot_delimiter", "process_docs", "process_results", "description", "fewshot_config"]
    for name in os.listdir(HARNESS_YAMLS):
        if not name.endswith(".yaml") or name == "fixture_mmlu.yaml":
            continue
        ours_cfg = load_yaml(os.path.join(HARNESS_YAMLS, name))
        with open(os.path.join(HARNESS_YAMLS, name)) as f:
            follows = re.search(r"# follows: (\S+)", f.read())
        if not follows:  # fixture_generate: a generation task of our own
            continue
        ref = load_yaml(os.path.join(root, follows.group(1)))
        for k in keys:
            assert same(ours_cfg.get(k), ref.get(k)), (name, k)
        ref_metrics = [m["metric"] for m in ref.get("metric_list", [])]
        assert [m["metric"] for m in ours_cfg["metric_list"]] == ref_metrics, name


# ----------------------------------------------------------------------------- metrics by hand


@needs_harness
def test_wikitext2_by_hand(ours, hand):
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    with open(os.path.join(FIX, "wikitext", "wikitext_document_level.jsonl")) as f:
        pages = [json.loads(line)["page"] for line in f]
    total, words, nbytes, ntok, windows = 0.0, 0, 0, 0, 0
    for page in pages:
        t = encode(wikitext_detokenizer({"page": page}))
        n = len(t)
        reqs = [([EOT] + t[:min(L, n) - 1], t[:min(L, n)])]  # window 1: EOT conditions token 0
        for start in range(L, n, L):  # then L new tokens a window, reading the L tokens before each
            end = min(start + L, n)
            reqs.append((t[end - L - 1:end - 1], t[start:end]))
        assert sum(len(r[1]) for r in reqs) == n
        total += sum(float(lp.sum()) for lp, _ in hand(reqs))
        words += len(re.split(r"\s+", page))
        nbytes += len(page.encode("utf-8"))
        ntok += n
        windows += len(reqs)
    r = ours["wikitext2"]
    assert r["samples"] == 3 and r["counts"]["windows"] == windows > 3 and r["counts"]["tokens"] == ntok
    m = r["metrics"]
    assert m["word_perplexity"] == pytest.approx(math.exp(-total / words), rel=1e-5)
    assert m["byte_perplexity"] == pytest.approx(math.exp(-total / nbytes), rel=1e-5)
    assert m["bits_per_byte"] == pytest.approx(-total / nbytes / math.log(2), rel=1e-5)
    assert m["token_perplexity"] == pytest.approx(math.exp(-total / ntok), rel=1e-5)
    assert m["token_perplexity"] < 0.5 * 50304  # trained: far from uniform
    assert r["data"]["sha256"] == data_lib.sha256_file(PATHS["wikitext2"])


def test_lambada_by_hand(ours, hand):
    texts = [json.loads(line)["text"] for line in open(PATHS["lambada"])]
    pairs = [(t.rsplit(" ", 1)[0], " " + t.rsplit(" ", 1)[1]) for t in texts]
    res = hand_requests(hand, pairs)
    r = ours["lambada"]
    assert r["samples"] == 6
    assert r["metrics"]["perplexity"] == pytest.approx(math.exp(-np.mean([ll for ll, _ in res])), rel=1e-5)
    assert r["metrics"]["acc"] == pytest.approx(np.mean([g for _, g in res]))


def _mc_by_hand(task):
    """(context, choices, gold) written out from each harness config by hand."""
    recs = [json.loads(line) for line in open(PATHS[task])]
    out = []
    for r in recs:
        if task == "hellaswag":
            def pre(s):
                s = s.strip().replace(" [title]", ". ")
                return re.sub(r"\[.*?\]", "", s).replace("  ", " ")
            out.append((pre(f"{r['activity_label']}: {r['ctx_a']} {r['ctx_b'].capitalize()}"),
                        [pre(e) for e in r["endings"]], int(r["label"])))
        elif task.startswith("arc"):
            out.append((f"Question: {r['question']}\nAnswer:", r["choices"]["text"],
                        r["choices"]["label"].index(r["answerKey"])))
        elif task == "piqa":
            out.append((f"Question: {r['goal']}\nAnswer:", [r["sol1"], r["sol2"]], r["label"]))
        elif task == "boolq":
            out.append((f"{r['passage']}\nQuestion: {r['question']}?\nAnswer:", ["no", "yes"], r["label"]))
        elif task == "sciq":
            out.append((f"{r['support'].lstrip()}\nQuestion: {r['question']}\nAnswer:",
                        [r["distractor1"], r["distractor2"], r["distractor3"], r["correct_answer"]], 3))
    return out


@pytest.mark.parametrize("task", MC_TASKS)
def test_multiple_choice_by_hand(task, ours, hand):
    docs = _mc_by_hand(task)
    res = hand_requests(hand, [(ctx, " " + c) for ctx, choices, _ in docs for c in choices])
    acc, by_bytes, by_chars, k = [], [], [], 0
    for ctx, choices, gold in docs:
        ll = np.array([x for x, _ in res[k:k + len(choices)]])
        k += len(choices)
        acc.append(np.argmax(ll) == gold)
        by_bytes.append(np.argmax(ll / np.array([len((" " + c).encode("utf-8")) for c in choices])) == gold)
        by_chars.append(np.argmax(ll / np.array([len(c) for c in choices])) == gold)
    r = ours[task]
    assert r["samples"] == len(docs)
    assert r["metrics"] == pytest.approx({"acc": np.mean(acc), "acc_norm_bytes": np.mean(by_bytes),
                                          "acc_norm_chars": np.mean(by_chars)})
    assert r["data"]["sha256"] == data_lib.sha256_file(PATHS[task])


def test_mmlu_by_hand(ours, hand):
    import csv

    correct, total, per = 0, 0, {}
    for subject in ["astronomy", "high_school_us_history"]:
        rows = {s: list(csv.reader(open(os.path.join(PATHS["mmlu"], s, f"{subject}_{s}.csv"))))
                for s in ("dev", "test")}

        def q(row):
            return f"{row[0].strip()}\nA. {row[1]}\nB. {row[2]}\nC. {row[3]}\nD. {row[4]}\nAnswer:"

        head = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
        shots = "".join(f"{q(r)} {r[5]}\n\n" for r in rows["dev"][:5])
        res = hand_requests(hand, [(head + shots + q(r), " " + x) for r in rows["test"] for x in "ABCD"])
        good = [int(np.argmax([ll for ll, _ in res[4 * i:4 * i + 4]])) == "ABCD".index(r[5])
                for i, r in enumerate(rows["test"])]
        correct, total, per[subject] = correct + sum(good), total + len(good), np.mean(good)
        assert len(encode(head + shots)) > L  # left truncation is exercised
    r = ours["mmlu"]
    assert r["samples"] == total == 5
    assert r["metrics"]["acc"] == pytest.approx(correct / total)  # micro: weighted by subject size
    assert r["metrics"]["acc_macro_subjects"] == pytest.approx(np.mean(list(per.values())))
    assert r["per_subject"]["astronomy"]["shots"] == 5
    assert r["data"]["sha256"] and set(r["data"]["files"]) == {
        "dev/astronomy_dev.csv", "dev/high_school_us_history_dev.csv",
        "test/astronomy_test.csv", "test/high_school_us_history_test.csv"}


# ----------------------------------------------------------------------------- against the harness


def test_metrics_equal_lm_evaluation_harness(ours, harness):
    """Our tasks and the harness's own run of the same model on the same fixtures."""
    pairs = {
        "wikitext2": {"word_perplexity": "word_perplexity", "byte_perplexity": "byte_perplexity",
                      "bits_per_byte": "bits_per_byte"},
        "lambada": {"perplexity": "perplexity", "acc": "acc"},
        **{t: {"acc": "acc", "acc_norm_chars": "acc_norm"} for t in MC_TASKS if t != "boolq"},
        "boolq": {"acc": "acc"},
        "mmlu": {"acc": "acc"},
    }
    for task, metrics in pairs.items():
        h = harness["results"][HARNESS_NAMES[task]]
        for ours_name, theirs in metrics.items():
            assert ours[task]["metrics"][ours_name] == pytest.approx(h[f"{theirs},none"], rel=1e-6), (task, ours_name)
        assert h["sample_len"] == ours[task]["samples"], task


def _harness_lls(harness, name):
    """Per document (in order), the harness's per-request (loglikelihood, is_greedy)."""
    samples = sorted(harness["samples"][name], key=lambda s: s["doc_id"])
    return [[tuple(r) if isinstance(r, (list, tuple)) else r for r in s["filtered_resps"]] for s in samples]


@pytest.mark.parametrize("task", MC_TASKS)
def test_choice_loglikelihoods_equal_the_harness(task, scorer, harness):
    """Every choice's log-likelihood, not just the accuracies (which a weak model makes coarse)."""
    examples, _ = multiple_choice.load(task, PATHS[task])
    lls, _ = multiple_choice.score(scorer, examples)
    theirs = _harness_lls(harness, HARNESS_NAMES[task])
    assert len(theirs) == len(lls)
    for mine, th in zip(lls, theirs):
        assert mine == pytest.approx([float(x[0]) for x in th], rel=1e-6)


def test_lambada_loglikelihoods_equal_the_harness(scorer, harness):
    lam = scorer.loglikelihood([lambada.split(t) for t in lambada.load(PATHS["lambada"])])
    th = [s[0] for s in _harness_lls(harness, HARNESS_NAMES["lambada"])]
    assert [x for x, _ in lam] == pytest.approx([float(x[0]) for x in th], rel=1e-6)
    assert [g for _, g in lam] == [bool(x[1]) for x in th]


@needs_harness
def test_generate_until_through_the_harness(scorer):
    """The harness's generation path: greedy Server.generate, prompt left-truncated to
    max_length - max_gen_toks, text cut at the `until` strings."""
    from lm_eval.tasks import TaskManager

    from onona_jax.eval.lm_eval_model import OnonaLM
    from onona_jax.tokenizer import decode

    lm = OnonaLM(scorer=scorer)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        out = lm_eval.simple_evaluate(
            model=lm, tasks=["fixture_generate"], bootstrap_iters=0, log_samples=True,
            task_manager=TaskManager(include_path=HARNESS_YAMLS, include_defaults=False))
    samples = sorted(out["samples"]["fixture_generate"], key=lambda s: s["doc_id"])
    texts = lambada.load(PATHS["lambada"])
    prompts = [encode(lambada.split(t)[0])[-(L - 30):] for t in texts]
    assert max(len(encode(lambada.split(t)[0])) for t in texts) > L - 30  # truncation exercised
    gens = lm.server.generate(prompts, 30, greedy=True, stop_tokens=(EOT,))
    assert any(gens)
    for s, gen in zip(samples, gens):
        want = decode(gen)
        for stop in ("\n", ".", "<|endoftext|>"):
            want = want.split(stop)[0]
        assert s["filtered_resps"][0] == want
    assert out["results"]["fixture_generate"]["sample_len"] == len(texts)


@needs_harness
def test_registered_model_from_model_args(trained, ours):
    """lm_eval.simple_evaluate(model="onona", model_args=...) restores the checkpoint itself."""
    import onona_jax.eval.lm_eval_model  # noqa: F401  (registers "onona")
    from lm_eval.tasks import TaskManager

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        out = lm_eval.simple_evaluate(
            model="onona", model_args=f"workdir={trained},batch_size=8,max_length={L},mesh=1x1x1",
            tasks=["fixture_lambada_openai"], bootstrap_iters=0, log_samples=False,
            task_manager=TaskManager(include_path=HARNESS_YAMLS, include_defaults=False))
    got = out["results"]["fixture_lambada_openai"]
    assert got["perplexity,none"] == pytest.approx(ours["lambada"]["metrics"]["perplexity"], rel=1e-6)


# ----------------------------------------------------------------------------- eval.py


def test_eval_cli_writes_tasks_json(trained, ours, tmp_path):
    spec = importlib.util.spec_from_file_location("onona_eval_cli", os.path.join(REPO, "eval.py"))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    result = cli.evaluate(trained, None, (1, 1, 1), ["val", "lambada", "arc_easy"],
                          cli.parse_task_data([f"lambada={PATHS['lambada']}"]), FIX, batch=8, max_length=L)
    assert result["step"] == 12 and "val_loss" in result and "val_loss_a_only" in result
    assert set(result["tasks"]) == {"lambada", "arc_easy"}
    assert result["tasks"]["lambada"]["metrics"] == pytest.approx(ours["lambada"]["metrics"], rel=1e-6)
    assert result["tasks"]["arc_easy"]["metrics"] == pytest.approx(ours["arc_easy"]["metrics"])
    assert result["tasks"]["arc_easy"]["data"]["path"] == PATHS["arc_easy"]
    path = tmp_path / "out.json"
    validation.write_json(result, str(path))
    back = json.loads(path.read_text())
    assert back["tasks"]["lambada"]["samples"] == 6 and len(back["tasks"]["lambada"]["data"]["sha256"]) == 64
    with pytest.raises(ValueError, match="task_data"):
        cli.parse_task_data(["lambada"])
