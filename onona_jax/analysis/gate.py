"""What the onóna gate learned: g_v = σ(wᵀ rmsnorm(M_v)) for every real token v.

    python -m onona_jax.analysis.gate --workdir=DIR [--step=N] [--output_dir=DIR/analysis]
        [--top=30] [--min_count=10] [--data_dir=PATH] [--split=train|heldout] [--max_tokens=0]

The gate is a lookup (SPEC §1): it depends on the input token only, so one value per
vocabulary entry describes it completely. g near 1 puts the next-token distribution on
softmax(Ah), near 0 on softmax(Bh). Reported, over the real tokens of the run's tokenizer
(data.tokenizer; GPT-2's 50,257 by default; the padding rows of the tables are left out):

* the distribution over the vocabulary (each token once) and over corpus occurrences (each
  token weighted by its count in a split of the run's data: by default the training split of
  cfg.data.dir, or DIR/data when the run used the bundled corpus; the report names which);
* the tokens leaning most to A (highest g) and to B (lowest g), over all tokens and over
  tokens seen at least --min_count times, with decoded text and counts;
* the gate per token class (`classify`: special, partial UTF-8, whitespace, digits,
  punctuation, word-initial, continuation, other);
* a histogram.

Writes OUTPUT_DIR/gate_step_<N>.{json,md,png} and prints the Markdown. The heads with a gate
declare it (`Head.gate_reads`, `gate_probs`): twin (the gate reads M[x]), input_gate (M[x]),
twin_output_only (A[x]); a head without one is an error, and so is a gate over more than two
tables. Definitions of every statistic are in the functions below (pure numpy, testable).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import unicodedata

import numpy as np

from absl import flags

from onona_jax import cli, paths
from onona_jax import tokenizer as tokenizer_lib

QUANTILES = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


def gated_heads() -> dict:
    """The registered heads with a gate and the rows it reads (symbol, definition), as the
    heads declare them (`Head.gate_reads`)."""
    from onona_jax import heads  # (here, not at the top: --help stays fast without jax)

    return {n: c.gate_reads for n, c in heads.HEADS.items() if c.gate_reads is not None}

CLASSES = {  # name -> definition; `classify` applies them in this order, the first match wins
    "special": "the tokenizer's special tokens (GPT-2's: the end-of-text token <|endoftext|>, 50256)",
    "partial_utf8": "bytes that are not valid UTF-8 on their own (a piece of a multi-byte character)",
    "whitespace": "every character is whitespace (' ', '\\n', '\\n\\n', runs of spaces)",
    "digits": "optional leading space, then only Unicode numbers (category N*)",
    "punctuation": "optional leading space, then only characters that are not letters, numbers or "
                   "whitespace (punctuation and symbols: GPT-2's ` ?[^\\s\\p{L}\\p{N}]+`)",
    "word_initial": "a space, then only letters (category L*): the start of a word ('Ġword')",
    "continuation": "only letters, no leading space: the inside or end of a word",
    "other": "anything else: mixed letters/digits/punctuation, contractions ('s, 't)",
}


# ----------------------------------------------------------------------------- pure functions


def _refuse_ungated(head: str, where: str) -> None:
    if head not in gated_heads():
        raise ValueError(f"gate analysis needs a gated head ({', '.join(gated_heads())}); {where} has head "
                         f"{head!r}, which has no gate")


def gate_of(params, cfg_model) -> np.ndarray:
    """g [V]: the gate of every input token as the head computes it (`gate_probs`, the weight
    of its first table), fp32 at full matmul precision. A gate over K ≠ 2 tables ([V, K]) is
    an error: this report reads a two-way gate (g and 1 − g)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from onona_jax import heads
    from onona_jax import params as params_lib

    _refuse_ungated(cfg_model.head, "this run")
    graphdef, _ = params_lib.abstract_state(lambda: heads.make_head(cfg_model))
    with jax.default_matmul_precision("highest"):
        head = nnx.merge(graphdef, jax.tree.map(jnp.asarray, params["head"]))
        g = np.asarray(head.gate_probs(jnp.arange(int(cfg_model.vocab_size))), np.float32)
    if g.ndim != 1:
        raise ValueError(f"gate analysis reads a gate over two tables (g, 1 − g); head {cfg_model.head!r} "
                         f"mixes {g.shape[-1]}")
    return g


def weighted_quantile(x: np.ndarray, weights: np.ndarray, q: float) -> float:
    """Inverse-CDF quantile of x under weights (numpy's method="inverted_cdf" applied to x
    repeated weight times): the smallest x whose cumulative weight reaches q·Σw. Entries of
    weight 0 never count, so every quantile is the gate of a token that occurs."""
    keep = weights > 0
    x, weights = np.asarray(x, np.float64)[keep], np.asarray(weights, np.float64)[keep]
    order = np.argsort(x, kind="stable")
    cum = np.cumsum(weights[order])
    i = int(np.searchsorted(cum, q * cum[-1], side="left"))
    return float(x[order][min(max(i, 0), len(x) - 1)])


def distribution(g: np.ndarray, weights: np.ndarray | None = None) -> dict:
    """Summary of gate values g, each once (weights None) or weighted (occurrence counts).

    mean and std (population, ddof=0) are weighted means; quantiles are numpy's linear
    interpolation unweighted and `weighted_quantile` (inverse CDF) weighted; frac_above_half
    is the (weighted) fraction with g > 0.5 strictly."""
    g = np.asarray(g, np.float64)
    if weights is None:
        n = int(g.size)
        return dict(
            n=n, mean=float(g.mean()), std=float(g.std()), min=float(g.min()), max=float(g.max()),
            quantiles={str(q): float(np.quantile(g, q)) for q in QUANTILES},
            frac_above_half=float(np.mean(g > 0.5)),
        )
    w = np.asarray(weights, np.float64)
    total = float(w.sum())
    if total <= 0:
        raise ValueError("occurrence weights sum to zero: the counted split has no tokens")
    mean = float((w * g).sum() / total)
    seen = w > 0
    return dict(
        n=int(round(total)), distinct=int(seen.sum()), mean=mean,
        std=float(np.sqrt((w * (g - mean) ** 2).sum() / total)),
        min=float(g[seen].min()), max=float(g[seen].max()),
        quantiles={str(q): weighted_quantile(g, w, q) for q in QUANTILES},
        frac_above_half=float(w[g > 0.5].sum() / total),
    )


def token_bytes(n: int | None = None, tok=None) -> list[bytes]:
    """The raw bytes of tokens 0..n-1 of `tok` (a `tokenizer.Tokenizer`, GPT-2's when None;
    n: all its entries when None)."""
    tok = tok if tok is not None else tokenizer_lib.load()
    return [tok.token_bytes(i) for i in range(tok.n_vocab if n is None else n)]


def token_text(raw: bytes) -> str:
    """Decoded text of one token (invalid UTF-8 pieces shown with U+FFFD)."""
    return raw.decode("utf-8", errors="replace")


def classify(token_id: int, raw: bytes, specials=frozenset({tokenizer_lib.EOT})) -> str:
    """The token class of one token (see CLASSES; the first matching rule wins); `specials`:
    the ids of the tokenizer's special tokens (GPT-2's by default)."""
    if token_id in specials:
        return "special"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "partial_utf8"
    if text.isspace():
        return "whitespace"
    core = text[1:] if text.startswith(" ") else text
    if not core:
        return "other"  # unreachable for GPT-2 (a lone space is whitespace)
    cats = [unicodedata.category(c) for c in core]
    if all(c.startswith("N") for c in cats):
        return "digits"
    if all(not c.startswith(("L", "N")) for c in cats) and not any(ch.isspace() for ch in core):
        return "punctuation"
    if core.isalpha():  # isalpha is exactly the L* categories
        return "word_initial" if text.startswith(" ") else "continuation"
    return "other"


def class_table(g: np.ndarray, classes: list[str], counts: np.ndarray | None) -> dict:
    """Per class: tokens, mean/std of g over them (each once), fraction with g > 0.5, their
    occurrences and the occurrence-weighted mean g (None when the class never occurs)."""
    g = np.asarray(g, np.float64)
    labels = np.asarray(classes)
    out = {}
    for name, definition in CLASSES.items():
        mask = labels == name
        if not mask.any():
            continue
        row = dict(definition=definition, n_tokens=int(mask.sum()), mean=float(g[mask].mean()),
                   std=float(g[mask].std()), frac_above_half=float(np.mean(g[mask] > 0.5)))
        if counts is not None:
            c = np.asarray(counts, np.float64)[mask]
            occ = float(c.sum())
            row["occurrences"] = int(occ)
            row["occurrence_mean"] = float((c * g[mask]).sum() / occ) if occ > 0 else None
        out[name] = row
    return out


def top_tokens(g: np.ndarray, k: int, largest: bool, mask: np.ndarray | None = None) -> np.ndarray:
    """Ids of the k tokens with the largest (or smallest) g among `mask` (all when None);
    ties go to the lower id."""
    g = np.asarray(g)
    ids = np.arange(g.size) if mask is None else np.flatnonzero(mask)
    key = -g[ids].astype(np.float64) if largest else g[ids].astype(np.float64)
    return ids[np.lexsort((ids, key))][:k]


def token_rows(ids, g, counts, texts, classes) -> list[dict]:
    total = None if counts is None else float(np.sum(counts))
    rows = []
    for i in ids:
        i = int(i)
        row = dict(id=i, text=texts[i], g=float(g[i]), cls=classes[i])
        if counts is not None:
            row["count"] = int(counts[i])
            row["frequency"] = float(counts[i] / total) if total else 0.0
        rows.append(row)
    return rows


def count_tokens(data_dir: str, split: str, n: int, max_tokens: int = 0) -> tuple[np.ndarray, int]:
    """(counts [n] int64, tokens counted) over a split of a prepared data dir, its first
    `max_tokens` tokens when positive; n: the tokenizer's entries. Ids >= n (none in data of
    that tokenizer) are not counted."""
    from onona_jax.data.pipeline import TokenStore

    store = TokenStore(data_dir, split)
    counts = np.zeros(n, np.int64)
    budget = max_tokens if max_tokens > 0 else len(store)
    seen = 0
    chunk = 1 << 24
    for shard in store.shards:
        for start in range(0, len(shard), chunk):
            if seen >= budget:
                break
            part = np.asarray(shard[start : start + min(chunk, budget - seen)])
            counts += np.bincount(part, minlength=max(n, int(part.max()) + 1))[:n]
            seen += len(part)
    return counts, seen


def analyze_arrays(g: np.ndarray, counts: np.ndarray | None, raw: list[bytes], top: int = 30,
                   min_count: int = 10, specials=frozenset({tokenizer_lib.EOT})) -> dict:
    """Every number of the report from the gate values g [n] of the real tokens, their
    occurrence counts [n] (or None), their bytes and the special tokens' ids."""
    texts = [token_text(b) for b in raw]
    classes = [classify(i, b, specials) for i, b in enumerate(raw)]
    out = dict(vocabulary=distribution(g))
    if counts is not None:
        out["occurrences"] = distribution(g, counts)
    out["classes"] = class_table(g, classes, counts)
    out["top_a"] = token_rows(top_tokens(g, top, True), g, counts, texts, classes)
    out["top_b"] = token_rows(top_tokens(g, top, False), g, counts, texts, classes)
    if counts is not None:
        frequent = counts >= min_count
        out["min_count"] = int(min_count)
        out["frequent_tokens"] = int(frequent.sum())
        out["top_a_frequent"] = token_rows(top_tokens(g, top, True, frequent), g, counts, texts, classes)
        out["top_b_frequent"] = token_rows(top_tokens(g, top, False, frequent), g, counts, texts, classes)
    return out


# ----------------------------------------------------------------------------- a run


def analyze(workdir: str, step: int | None = None, data_dir: str | None = None, split: str = "train",
            top: int = 30, min_count: int = 10, max_tokens: int = 0, mesh=(-1, 1, 1)):
    """(report dict, g [n], counts [n]) for a run's checkpoint (the latest unless `step`)."""
    from onona_jax.checkpoint import restore_params, saved_config
    from onona_jax.eval import validation as evaluation

    cfg = saved_config(workdir, step)
    head = cfg.model.head
    _refuse_ungated(head, workdir)
    if split not in ("train", "heldout"):
        raise ValueError(f"split {split!r}: train or heldout")
    params, step, cfg, _ = restore_params(workdir, step, mesh)
    tok = tokenizer_lib.from_config(cfg.data)  # the run's: its entries, their bytes, its special tokens
    n = min(tok.n_vocab, int(cfg.model.vocab_size))
    g = gate_of(params, cfg.model)[:n]

    data_dir = data_dir or evaluation.data_dir(cfg, workdir)
    counts, counted = count_tokens(data_dir, split, n, max_tokens)
    report = dict(
        workdir=paths.absolute(workdir), step=int(step), config=cfg.name, head=head,
        gate_reads=gated_heads()[head][0],
        gate=f"g_v = σ(wᵀ rmsnorm({gated_heads()[head][0]}_v)), {gated_heads()[head][1]}; "
             "g → 1 leans to softmax(Ah), g → 0 to softmax(Bh)",
        vocab_tokens=n, table_rows=int(cfg.model.vocab_size), tokenizer=tok.identity(),
        occurrence_source=dict(data_dir=paths.absolute(data_dir), split=split, tokens=int(counted),
                               whole_split=max_tokens <= 0 or counted < max_tokens),
        **analyze_arrays(g, counts, token_bytes(n, tok), top, min_count,
                         frozenset(i for _, i in tok.special_tokens)),
    )
    return report, g, counts


# ----------------------------------------------------------------------------- outputs


def _fmt_text(text: str) -> str:
    """A token for a Markdown table: control characters and whitespace other than ' ' escaped
    (\\n, \\x0c, \\xa0), the rest as is, in a code span."""
    s = "".join(repr(c)[1:-1] if unicodedata.category(c) == "Cc" or (c.isspace() and c != " ") else c
                for c in text).replace("|", "\\|")
    return f"`` {s} ``" if "`" in s else f"`{s}`"


def _dist_row(label: str, d: dict) -> str:
    q = d["quantiles"]
    cells = [f"{d['mean']:.4f}", f"{d['std']:.4f}"] + [f"{q[str(p)]:.4f}" for p in QUANTILES]
    return f"| {label} | {d['n']:,} | " + " | ".join(cells) + f" | {d['frac_above_half']:.3f} |"


def _token_table(rows: list[dict]) -> list[str]:
    has_counts = bool(rows) and "count" in rows[0]
    head = "| rank | id | token | g | class |" + (" count | frequency |" if has_counts else "")
    out = [head, "|" + "---|" * (7 if has_counts else 5)]
    for r, row in enumerate(rows, 1):
        line = f"| {r} | {row['id']} | {_fmt_text(row['text'])} | {row['g']:.4f} | {row['cls']} |"
        if has_counts:
            line += f" {row['count']:,} | {row['frequency']:.2e} |"
        out.append(line)
    return out


def markdown(report: dict) -> str:
    src = report.get("occurrence_source", {})
    lines = [
        f"# Gate analysis: {report['config'] or report['workdir']} (step {report['step']})",
        "",
        f"Head `{report['head']}`: {report['gate']}.",
        f"Vocabulary: the {report['vocab_tokens']:,} real tokens (table padding rows "
        f"{report['vocab_tokens']}..{report['table_rows'] - 1} left out).",
    ]
    if "occurrences" in report:
        lines.append(
            f"Occurrences: token counts of the `{src['split']}` split of `{src['data_dir']}` "
            f"({src['tokens']:,} tokens{'' if src.get('whole_split', True) else ', a prefix'})."
        )
    qs = " | ".join(f"q{p:g}" for p in QUANTILES)
    lines += ["", "## Distribution of g", "",
              f"| over | n | mean | std | {qs} | frac g > 0.5 |",
              "|" + "---|" * (5 + len(QUANTILES)),
              _dist_row("vocabulary (each token once)", report["vocabulary"])]
    if "occurrences" in report:
        lines.append(_dist_row("occurrences (count-weighted)", report["occurrences"]))
    lines += ["", "Vocabulary quantiles interpolate linearly; occurrence quantiles are inverse-CDF "
              "(the gate of an actual token).", "", "## Gate by token class", "",
              "| class | tokens | mean g | std | frac g > 0.5 | occurrences | occurrence-weighted mean g |",
              "|---|---|---|---|---|---|---|"]
    for name, c in report["classes"].items():
        occ = c.get("occurrence_mean")
        lines.append(f"| {name} | {c['n_tokens']:,} | {c['mean']:.4f} | {c['std']:.4f} | "
                     f"{c['frac_above_half']:.3f} | {c.get('occurrences', 0):,} | "
                     f"{'—' if occ is None else f'{occ:.4f}'} |")
    lines += ["", "Classes (the first matching rule wins):", ""]
    lines += [f"- **{name}**: {d}" for name, d in CLASSES.items()]
    for key, title in (("top_a", "Leaning to A (highest g), all tokens"),
                       ("top_b", "Leaning to B (lowest g), all tokens"),
                       ("top_a_frequent", f"Leaning to A, tokens seen at least {report.get('min_count')} times"),
                       ("top_b_frequent", f"Leaning to B, tokens seen at least {report.get('min_count')} times")):
        if key in report:
            lines += ["", f"## {title}", ""] + _token_table(report[key])
    return "\n".join(lines) + "\n"


def histogram(g: np.ndarray, counts: np.ndarray | None, path: str, title: str = "", rows: str = "M") -> bool:
    """Histogram PNG of g over the vocabulary and (when counts) over occurrences; False
    when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; skipping the histogram (pip install matplotlib)", file=sys.stderr)
        return False
    g = np.asarray(g, np.float64)
    lo, hi = float(g.min()), float(g.max())
    if hi - lo < 1e-6:
        lo, hi = lo - 1e-3, hi + 1e-3
    bins = np.linspace(lo, hi, 61)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(g, bins=bins, density=True, alpha=0.6, label=f"vocabulary ({g.size:,} tokens)")
    if counts is not None and np.sum(counts) > 0:
        ax.hist(g, bins=bins, weights=counts, density=True, alpha=0.6,
                label=f"occurrences ({int(np.sum(counts)):,})")
    if lo <= 0.5 <= hi:
        ax.axvline(0.5, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel(f"gate g = σ(wᵀ rmsnorm({rows}_v))   (1: softmax(Ah), 0: softmax(Bh))")
    ax.set_ylabel("density")
    ax.set_title(title or "onóna gate", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write(report: dict, g: np.ndarray, counts: np.ndarray | None, output_dir: str) -> dict:
    """Write gate_step_<N>.{json,md,png} into output_dir (local or a bucket), each whole;
    returns {kind: path}."""
    stem = paths.join(output_dir, f"gate_step_{report['step']}")
    files = {"json": stem + ".json", "markdown": stem + ".md", "png": stem + ".png"}
    title = f"{report['config']} step {report['step']}: gate distribution"
    with tempfile.TemporaryDirectory() as tmp:  # matplotlib writes local files
        png = os.path.join(tmp, "gate.png")
        if histogram(g, counts, png, title, report.get("gate_reads", "M")):
            paths.upload(png, files["png"])
        else:
            del files["png"]
    report = {**report, "files": files}
    paths.write_atomic(files["markdown"], markdown(report))
    paths.write_atomic(files["json"], json.dumps(report, indent=2, ensure_ascii=False))
    return files


def define(fv, argv):
    flags.DEFINE_string("workdir", None, "run directory with checkpoints/", flag_values=fv, required=True)
    flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)", flag_values=fv)
    flags.DEFINE_string("output_dir", None, "default: WORKDIR/analysis", flag_values=fv)
    flags.DEFINE_integer("top", 30, "tokens per top list", flag_values=fv)
    flags.DEFINE_integer("min_count", 10, "occurrences for the 'frequent' top lists", flag_values=fv)
    flags.DEFINE_string("data_dir", None, "prepared data to count tokens in (default: the run's)", flag_values=fv)
    flags.DEFINE_enum("split", "train", ("train", "heldout"), "split to count tokens in", flag_values=fv)
    flags.DEFINE_integer("max_tokens", 0, "count only the split's first N tokens (0: all)", flag_values=fv)
    cli.define_mesh(fv)


def _main(fv, args):
    if args:
        raise cli.UsageError(f"unexpected arguments {args}")
    report, g, counts = analyze(fv.workdir, fv.step, fv.data_dir, fv.split, fv.top, fv.min_count,
                                fv.max_tokens, cli.mesh(fv))
    files = write(report, g, counts, fv.output_dir or paths.Workdir(fv.workdir).analysis)
    print(markdown(report))
    print("wrote " + ", ".join(files.values()), file=sys.stderr)


def main(argv=None) -> int:
    return cli.run(define, _main, argv, __doc__)


if __name__ == "__main__":
    cli.run_module(define, _main, __doc__)
