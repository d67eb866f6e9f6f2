"""The transformers export (`onona_jax.serve.export`, `serve/hf/modeling_onona.py`) and import
(`python -m onona_jax.train.import_hf --from_hf`), held to the JAX model.

Each family × head (all nine): a tiny model with noisy parameters (logits of order one, so a misplaced
weight shows) is exported, loaded with `AutoModelForCausalLM.from_pretrained(OUT,
trust_remote_code=True)`, and must give the JAX model's log-probabilities (1e-4; fp32 on
both sides, the differences are summation order), the same greedy continuations as
`serving.Server.generate(greedy=True)` on three prompts, and read back bit-exactly. The
default suite runs dense-twin (and lm-evaluation-harness on it); the rest of the grid is `slow`:

    python -m pytest -q -m '' tests/integration/test_hf_export.py
"""

import ast
import json
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing is downloaded
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from conftest import REPO, tiny_config  # noqa: E402
from onona_jax.checkpoint import restore_params
from onona_jax.train import import_hf
from onona_jax.models import moe
from onona_jax.serve import server as serving
from onona_jax.eval import tasks
from onona_jax import models as model_lib  # noqa: E402
from onona_jax.serve import hf_format  # noqa: E402
from onona_jax.tokenizer import EOT  # noqa: E402

FAMILIES = ["dense", "moe", "gdn", "attnres"]
HEADS = list(hf_format.HEADS)
DEFAULT = {("dense", "twin")}
GRID = [pytest.param(a, h, id=f"{a}-{h}", marks=() if (a, h) in DEFAULT else pytest.mark.slow)
        for a in FAMILIES for h in HEADS]
PROMPTS = [[EOT, 464, 3290], [40, 716, 257, 1310, 11, 290], [1026]]
NEW = 10
FIX = os.path.join(REPO, "tests", "fixtures")


def _noisy_params(m, seed=0):
    """Initialised params plus N(0, 0.1²) noise on every leaf (as test_parity_torch)."""
    _, params = model_lib.init(m, seed)
    leaves, treedef = jax.tree.flatten(params)
    r = np.random.default_rng(seed)
    return jax.tree.unflatten(treedef, [x + 0.1 * r.standard_normal(x.shape, np.float32) for x in leaves])


class Exported:
    def __init__(self, arch, head, root):
        from transformers import AutoModelForCausalLM

        self.cfg = tiny_config(str(root / "no-data"), head=head, arch=arch)
        if arch == "gdn":  # parity with transformers' fp32 recurrence to 1e-4
            self.cfg.model.gdn.precision = "highest"
        self.m = moe.eval_config(self.cfg.model)  # MoE: the evaluation capacity, nothing dropped
        self.params = _noisy_params(self.cfg.model)
        self.out = str(root / f"{arch}-{head}")
        self.kind, self.files = hf_format.export(self.params, self.cfg, self.out)
        self.hf = AutoModelForCausalLM.from_pretrained(self.out, trust_remote_code=True).eval()


_CACHE = {}


@pytest.fixture
def exported(request, tmp_path_factory):
    """(arch, head) -> an Exported, made once per session."""

    def get(arch, head):
        if (arch, head) not in _CACHE:
            _CACHE[(arch, head)] = Exported(arch, head, tmp_path_factory.mktemp("hf"))
        return _CACHE[(arch, head)]

    return get


@pytest.mark.parametrize("arch,head", GRID)
def test_transformers_matches_jax(arch, head, exported):
    e = exported(arch, head)
    plain = {"dense": "Qwen3ForCausalLM", "moe": "Qwen3MoeForCausalLM"}
    expected = plain[arch] if arch in plain and head in ("standard", "untied") else "OnonaForCausalLM"
    assert type(e.hf).__name__ == expected
    # every file it wrote (tokenizer's included) is one an export's --overwrite replaces
    assert sorted(os.listdir(e.out)) == e.files and set(e.files) <= set(hf_format.EXPORT_FILES)
    if type(e.hf).__name__ == "OnonaForCausalLM":  # the code travels with the folder
        assert {"configuration_onona.py", "modeling_onona.py"} <= set(os.listdir(e.out))
        assert json.load(open(os.path.join(e.out, "config.json")))["auto_map"] == hf_format.AUTO_MAP
        for name in hf_format.CODE_FILES:  # transformers alone: no import of this package
            tree = ast.parse(open(os.path.join(e.out, name)).read())
            imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
            imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
            assert not [i for i in imported if i.startswith("onona")], (name, imported)

    # log-probabilities over two rows of 21 tokens
    tokens = np.random.default_rng(1).integers(0, 50257, (2, 21))
    ours = np.asarray(model_lib.bind(model_lib.abstract(e.m)[0], e.params)(tokens))
    with torch.no_grad():
        theirs = torch.log_softmax(e.hf(torch.from_numpy(tokens)).logits.float(), -1).numpy()
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4)

    # greedy decoding with the cache, token for token, one prompt at a time and left-padded
    server = serving.Server(e.cfg, e.params)
    want = server.generate(PROMPTS, NEW, greedy=True)
    for prompt, w in zip(PROMPTS, want):
        ids = torch.tensor([prompt])
        with torch.no_grad():  # the mask says EOT is a token here, not padding
            got = e.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                eos_token_id=None, pad_token_id=EOT)
        assert got[0, len(prompt):].tolist() == w
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[EOT] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    with torch.no_grad():
        got = e.hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                            eos_token_id=None, pad_token_id=EOT)
    assert got[:, width:].tolist() == want

    # the export reads back bit-exactly
    back = hf_format.from_hf({k: v.numpy() for k, v in e.hf.state_dict().items()}, e.cfg.model)
    assert jax.tree.structure(back) == jax.tree.structure(e.params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(e.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def _jax_token_log_probs(e, sequences):
    """log p of every token after the first under the JAX model, [B, T-1] (float64)."""
    seq = np.asarray(sequences)
    lp = np.asarray(model_lib.bind(model_lib.abstract(e.m)[0], e.params)(seq[:, :-1]))
    return np.take_along_axis(lp, seq[:, 1:, None], -1)[..., 0].astype(np.float64)


def test_beam_search_and_sampling_act_on_the_mixture(exported):
    """Beam search (cache reordered between beams) and sampling: the per-token scores
    transformers reports for the chosen tokens are the JAX model's log-probabilities."""
    e = exported("dense", "twin")
    prompt = torch.tensor([PROMPTS[1]])
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=6, eos_token_id=None, pad_token_id=EOT,
              output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        beam = e.hf.generate(prompt, num_beams=3, num_return_sequences=3, do_sample=False, **kw)
        torch.manual_seed(0)
        sample = e.hf.generate(prompt, do_sample=True, top_k=0, **kw)
    n = prompt.shape[1]
    for out, beams in ((beam, beam.beam_indices), (sample, None)):
        steps = e.hf.compute_transition_scores(out.sequences, out.scores, beams, normalize_logits=False).numpy()
        ours = _jax_token_log_probs(e, out.sequences)[:, n - 1:]
        np.testing.assert_allclose(steps, ours, rtol=0, atol=1e-4)
    assert len({tuple(s) for s in beam.sequences.tolist()}) == 3  # three different beams


@pytest.fixture
def imported(exported, tmp_path_factory):
    """The dense-twin export imported with `python -m onona_jax.train.import_hf --from_hf` (once)."""
    if "imported" not in _CACHE:
        e = exported("dense", "twin")
        workdir = str(tmp_path_factory.mktemp("imported") / "run")
        assert import_hf.main([f"--from_hf={e.out}", f"--workdir={workdir}"]) == 0
        _CACHE["imported"] = workdir
    return _CACHE["imported"]


def test_import_round_trip_is_bit_exact(exported, imported):
    """JAX → HF → `python -m onona_jax.train.import_hf --from_hf` → workdir: the checkpoint (step 0,
    the export's config) holds bit-identical parameters, restored onto another mesh."""
    e = exported("dense", "twin")
    params, step, cfg, _ = restore_params(imported, mesh=(1, 1, 1), devices=jax.devices()[:1])
    assert step == 0 and cfg.model.to_dict() == e.cfg.model.to_dict()
    assert jax.tree.structure(params) == jax.tree.structure(e.params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(e.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # a second import into the same workdir is refused before anything is written
    assert import_hf.main([f"--from_hf={e.out}", f"--workdir={imported}"]) == 2


def test_lm_eval_hf_model_equals_our_tasks(exported, imported, monkeypatch):
    """lm-evaluation-harness's `hf` model on the export folder gives the same WikiText-2 word
    perplexity and LAMBADA accuracy and perplexity as our tasks (eval.py's) on the imported
    workdir (1e-4 relative; fp32 on both sides)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    e = exported("dense", "twin")
    L = 64
    paths = {"wikitext2": os.path.join(FIX, "wikitext", "wiki.test.raw"),
             "lambada": os.path.join(FIX, "lambada_openai.jsonl")}
    scorer = tasks.Scorer.from_workdir(imported, mesh=(1, 1, 1), devices=jax.devices()[:1], batch_size=8,
                                       max_length=L)
    ours = tasks.evaluate(scorer, list(paths), paths)
    monkeypatch.chdir(REPO)  # the fixture YAMLs name their data relative to the repository root
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={e.out},trust_remote_code=True,dtype=float32,device=cpu,max_length={L}",
        tasks=["fixture_wikitext", "fixture_lambada_openai"], batch_size=8, bootstrap_iters=0,
        task_manager=TaskManager(include_path=os.path.join(FIX, "lm_eval_tasks"), include_defaults=False),
    )["results"]
    assert ours["wikitext2"]["metrics"]["word_perplexity"] == pytest.approx(
        theirs["fixture_wikitext"]["word_perplexity,none"], rel=1e-4)
    for name in ("acc", "perplexity"):
        assert ours["lambada"]["metrics"][name] == pytest.approx(
            theirs["fixture_lambada_openai"][f"{name},none"], rel=1e-4)
    assert theirs["fixture_lambada_openai"]["sample_len"] == ours["lambada"]["samples"]


@pytest.mark.slow
def test_imported_standard_checkpoint_upcycles(exported, tmp_path):
    """`train.py --config.init_from=<imported dense-standard workdir>`: the twin model starts
    with A = B = the imported E and the imported body."""
    from onona_jax import train as trainer

    e = exported("dense", "standard")
    workdir = str(tmp_path / "standard")
    assert import_hf.main([f"--from_hf={e.out}", f"--workdir={workdir}"]) == 0
    cfg = tiny_config(str(tmp_path / "no-data"), head="twin")
    run = trainer.setup(cfg)
    state = trainer.upcycle(run, trainer.init_state(run, 0), workdir)
    params = jax.device_get(state["params"])
    for table in ("A", "B"):
        assert np.array_equal(params["head"][table], np.asarray(e.params["head"]["embedding"]))
    for a, b in zip(jax.tree.leaves(params["trunk"]), jax.tree.leaves(e.params["trunk"])):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_import_refuses_what_it_cannot_represent(tmp_path, capsys):
    folder = tmp_path / "qwen3"
    folder.mkdir()
    hf = {"model_type": "qwen3", "vocab_size": 50304, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 192,
          "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True, "attention_bias": True}
    (folder / "config.json").write_text(json.dumps(hf))
    assert import_hf.main([f"--from_hf={folder}", f"--workdir={tmp_path / 'w'}"]) == 2
    assert "attention_bias=true" in capsys.readouterr().err
    (folder / "config.json").write_text(json.dumps({**hf, "attention_bias": False, "vocab_size": 32000}))
    assert import_hf.main([f"--from_hf={folder}", f"--workdir={tmp_path / 'w'}"]) == 2
    err = capsys.readouterr().err  # no tokenizer.json: read as GPT-2's, whose 50,257 ids 32,000 rows cannot hold
    assert "has no tokenizer.json" in err and "vocab_size=32,000 is below its tokenizer's 50,257 entries" in err
    assert not (tmp_path / "w").exists()
    m = tiny_config(str(tmp_path), head="twin").model
    m.head = "softmax_bottleneck"
    with pytest.raises(ValueError, match="export supports families dense, moe, gdn, attnres with any head"):
        hf_format.check_supported(m)
