"""eval/'s suites and tasks, and the report's statistics: the shipped suites and what a bad one says,
the offline tasks against the stock lm-eval task files (prompt, metrics, local data), and the
standard errors of a difference (paired, bootstrapped) against their definitions."""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import lm_eval
import numpy as np
import pytest

from ladder.errors import UsageError
from ladder.eval import cli, report
from ladder.eval.lm_tasks import TASKS_DIR, task_manager
from ladder.eval.suite import Suite, SuiteTask, load_suite, parse_suite, suite_names

LM_EVAL_TASKS = Path(inspect.getfile(lm_eval)).parent / "tasks"
OFFLINE_TASKS = {  # our task: (stock task yaml, items in the scored split)
    "ladder_wikitext": ("wikitext/wikitext.yaml", 62),
    "ladder_lambada_openai": ("lambada/lambada_openai.yaml", 5153),
    "ladder_piqa": ("piqa/piqa.yaml", 1838),
    "ladder_arc_easy": ("arc/arc_easy.yaml", 2376),
    "ladder_arc_challenge": ("arc/arc_challenge.yaml", 1172),
    "ladder_hellaswag": ("hellaswag/hellaswag.yaml", 10042),
}


@pytest.fixture(scope="module")
def our_tasks():
    return task_manager(Suite("ours", "", True, tuple(SuiteTask(task=t) for t in OFFLINE_TASKS)))


# --- suites ---------------------------------------------------------------------------------


def test_shipped_suites_load_and_name_known_tasks(our_tasks):
    assert {"smoke", "offline", "offline-cpu", "demo", "paper"} <= set(suite_names())
    for name in ("smoke", "offline", "offline-cpu", "demo"):
        suite = load_suite(name)
        assert suite.offline and {t.task for t in suite.tasks} == set(OFFLINE_TASKS)
        assert all(t.task in our_tasks.all_tasks for t in suite.tasks)
    assert all(t.limit for t in load_suite("smoke").tasks)
    paper = load_suite("paper")
    assert not paper.offline and {t.task: t.num_fewshot for t in paper.tasks}["mmlu"] == 5


def test_paper_suite_names_resolve_in_lm_eval():
    """The stock names resolve in lm-eval's task index (no dataset is downloaded to check this)."""
    suite = load_suite("paper")
    manager = task_manager(suite)
    assert [t.task for t in suite.tasks if t.task not in manager.all_tasks] == []


@pytest.mark.parametrize(
    "data, message",
    [
        (["ladder_piqa"], "expected a mapping"),
        ({"tasks": []}, r"tasks = \[\]: list should have at least 1 item"),
        ({"tasks": ["ladder_piqa"], "shots": 5}, "unknown key"),
        ({"tasks": [{"task": "ladder_piqa", "fewshot": 5}]}, r"task 1 \(ladder_piqa\): unknown key"),
        ({"tasks": [{"task": "ladder_piqa", "limit": 0}]}, "limit = 0: input should be greater than or equal to 1"),
        (
            {"tasks": [{"task": "ladder_piqa", "num_fewshot": -1}]},
            "num_fewshot = -1: input should be greater than or equal to 0",
        ),
        ({"tasks": [{"limit": 3}]}, "task 1: task = .*: field required"),
        ({"tasks": ["ladder_piqa", "ladder_piqa"]}, "listed twice"),
        ({"tasks": ["ladder_piqa"], "offline": "yes"}, "offline = 'yes': input should be a valid boolean"),
        ({"tasks": [{"task": "ladder_piqa", "fewshot_as_multiturn": True}]}, "fewshot_as_multiturn needs apply_chat"),
        (
            {"tasks": [{"task": "ladder_piqa", "apply_chat_template": 1}]},
            "apply_chat_template = 1: input should be a valid boolean",
        ),
        (
            {"tasks": [{"task": "ladder_piqa", "gen_kwargs": "max_gen_toks=5"}]},
            "gen_kwargs = 'max_gen_toks=5': input should be a valid dictionary",
        ),
        (
            {"tasks": [{"task": "ladder_piqa", "system_instruction": 3}]},
            "system_instruction = 3: input should be a valid string",
        ),
    ],
)
def test_bad_suites_name_the_fault(data, message):
    with pytest.raises(UsageError, match=message):
        parse_suite(data, "mine")


def test_limit_caps_every_task():
    suite = parse_suite({"tasks": [{"task": "a", "limit": 3}, "b"]}, "s").with_limit(5)
    assert [t.limit for t in suite.tasks] == [3, 5]


def test_chat_options_from_the_suite_and_the_command_line():
    paper = load_suite("paper")
    gsm8k = next(t for t in paper.tasks if t.task.startswith("gsm8k"))
    assert gsm8k.apply_chat_template is True and gsm8k.fewshot_as_multiturn
    assert not any(t.apply_chat_template for t in paper.tasks if t is not gsm8k)  # log-likelihood tasks: plain
    # A base model: plain prompts everywhere, and with them no few-shot turns.
    plain = paper.with_options(apply_chat_template=False)
    assert not any(t.apply_chat_template or t.fewshot_as_multiturn for t in plain.tasks)
    options = (
        parse_suite({"tasks": ["a"]}, "s")
        .with_options(
            apply_chat_template="chatml",
            fewshot_as_multiturn=True,
            system_instruction="Be brief.",
            gen_kwargs={"max_gen_toks": 16, "until": ["\n"]},
        )
        .tasks[0]
        .chat_options()
    )
    assert options == {
        "apply_chat_template": "chatml",
        "fewshot_as_multiturn": True,
        "system_instruction": "Be brief.",
        "gen_kwargs": {"max_gen_toks": 16, "until": ["\n"]},
    }
    assert cli._gen_kwargs("max_gen_toks=512,temperature=0,do_sample=false") == {
        "max_gen_toks": 512,
        "temperature": 0,
        "do_sample": False,
    }


# --- offline tasks --------------------------------------------------------------------------


def harness_yaml(path: Path) -> dict:
    """A task YAML as lm-eval reads it: `include:` merged, `!function` resolved."""
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(path, resolve_func=True, recursive=True)


def _same(ours, stock) -> bool:
    if callable(ours) and callable(stock):
        return inspect.getsource(ours) == inspect.getsource(stock)
    return ours == stock


@pytest.mark.parametrize("task", sorted(OFFLINE_TASKS))
def test_offline_tasks_copy_the_stock_prompt_and_metrics(task):
    stock_file, _ = OFFLINE_TASKS[task]
    ours = harness_yaml(TASKS_DIR / f"{task}.yaml")
    stock = harness_yaml(LM_EVAL_TASKS / stock_file)
    for key in ("output_type", "doc_to_text", "doc_to_target", "doc_to_choice", "process_results", "metric_list"):
        if key == "doc_to_target" and task == "ladder_hellaswag":
            continue  # stock "{{label}}" reads HF's string label; ours is the same template on an int
        assert _same(ours.get(key), stock.get(key)), key
    assert ours["metadata"]["version"] == stock["metadata"]["version"]


def test_offline_tasks_read_the_local_files(our_tasks):
    loaded = our_tasks.load(list(OFFLINE_TASKS))["tasks"]
    for name, (_, size) in OFFLINE_TASKS.items():
        assert len(loaded[name].eval_docs) == size, name
    hellaswag = loaded["ladder_hellaswag"]
    first = hellaswag.eval_docs[0]
    # HellaSwag val item 0 through the stock preprocessing: ctx_b "he" is capitalized.
    assert hellaswag.doc_to_text(first) == "Roof shingle removal: A man is sitting on a roof. He"
    assert hellaswag.doc_to_choice(first)[3] == "starts pulling up roofing on a roof."
    assert hellaswag.doc_to_target(first) == 3
    wikitext = loaded["ladder_wikitext"]
    page = wikitext.eval_docs[0]["page"]
    assert page.startswith(" = Robert Boulter = \n") and "\r" not in page
    assert wikitext.doc_to_target(wikitext.eval_docs[0]).startswith(" = Robert Boulter =\n")
    arc = loaded["ladder_arc_challenge"]
    assert arc.doc_to_text(arc.eval_docs[0]).startswith("Question: ") and arc.eval_docs[0]["answerKey"]


# --- the report's standard errors -----------------------------------------------------------


def _record(task: str, key: str, doc_ids, values, aggregation: str, value=None, stderr=None) -> dict:
    metric = key.split(",")[0]
    return {
        "results": {task: {key: value, f"{metric}_stderr,none": stderr}},
        "per_item": {task: {key: {"doc_id": list(doc_ids), "value": list(values)}}},
        "aggregations": {task: {metric: aggregation}},
    }


def test_difference_of_means_is_paired():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2, 200).astype(float)
    b = np.where(rng.random(200) < 0.9, a, 1 - a)  # agrees with `a` on ~90% of items
    ref = _record("t", "acc,none", range(200), a, "mean", a.mean(), a.std(ddof=1) / math.sqrt(200))
    other = _record("t", "acc,none", range(200), b, "mean", b.mean(), b.std(ddof=1) / math.sqrt(200))
    score_ref, score = report._score(ref, "t", "acc,none"), report._score(other, "t", "acc,none")
    difference = report._difference(ref, other, "t", "acc,none", score_ref, score)
    assert difference.method == "paired"
    assert difference.value == pytest.approx(b.mean() - a.mean())
    assert difference.stderr == pytest.approx((b - a).std(ddof=1) / math.sqrt(200))
    # Correlated scores: the paired error is well below the independent one.
    assert difference.stderr < 0.6 * math.hypot(score_ref.stderr, score.stderr)
    # Different items: fall back to the independent formula, and say so.
    moved = _record("t", "acc,none", range(1, 201), b, "mean", b.mean(), score.stderr)
    fallback = report._difference(ref, moved, "t", "acc,none", score_ref, score)
    assert fallback.method == "independent"
    assert fallback.stderr == pytest.approx(math.hypot(score_ref.stderr, score.stderr))


def test_perplexity_stderr_is_bootstrapped_when_lm_eval_gives_none():
    rng = np.random.default_rng(1)
    pairs = [[float(-rng.uniform(100, 300)), int(rng.integers(50, 150))] for _ in range(40)]
    ref = _record("w", "word_perplexity,none", range(40), pairs, "weighted_perplexity", 7.0, "N/A")
    same = report._score(ref, "w", "word_perplexity,none")
    assert same.stderr is not None and same.stderr > 0
    identical = report._difference(ref, ref, "w", "word_perplexity,none", same, same)
    assert identical.method == "paired" and identical.stderr == 0.0


def test_paired_bootstrap_of_two_models_matches_the_delta_method():
    # Word perplexity of two different, correlated models on the same 300 documents: the report's
    # paired bootstrap standard error of the difference against the delta method (linearizing
    # exp(-sum(ll) / sum(words)) per document), an independent computation of the same quantity.
    rng = np.random.default_rng(2)
    words = rng.integers(50, 150, 300)
    ll_a = -words * rng.normal(3.0, 0.3, 300)
    ll_b = ll_a - words * rng.normal(0.2, 0.1, 300)  # the second model: worse, and not uniformly
    pairs_a = [[float(ll), int(w)] for ll, w in zip(ll_a, words)]
    pairs_b = [[float(ll), int(w)] for ll, w in zip(ll_b, words)]
    ppl_a, ppl_b = math.exp(-ll_a.sum() / words.sum()), math.exp(-ll_b.sum() / words.sum())
    ref = _record("w", "word_perplexity,none", range(300), pairs_a, "weighted_perplexity", ppl_a, "N/A")
    other = _record("w", "word_perplexity,none", range(300), pairs_b, "weighted_perplexity", ppl_b, "N/A")
    score_ref, score = (
        report._score(ref, "w", "word_perplexity,none"),
        report._score(other, "w", "word_perplexity,none"),
    )
    difference = report._difference(ref, other, "w", "word_perplexity,none", score_ref, score)
    assert difference.method == "paired" and difference.value == pytest.approx(ppl_b - ppl_a)

    total = words.sum()
    influence = -ppl_b * (ll_b / total + words / total * math.log(ppl_b)) + ppl_a * (
        ll_a / total + words / total * math.log(ppl_a)
    )
    delta_method = math.sqrt((influence**2).sum())
    assert difference.stderr == pytest.approx(delta_method, rel=0.1)
    assert difference.stderr < 0.5 * math.hypot(score_ref.stderr, score.stderr)  # pairing matters here


def test_vectorised_bootstrap_is_lm_evals_aggregation_resampled():
    # The numpy forms of lm-eval's aggregations give the standard errors that resampling lm-eval's
    # own functions gives (the same draws), single and paired.
    from lm_eval.api.registry import AGGREGATION_REGISTRY

    rng = np.random.default_rng(3)
    pairs_a = [[float(-rng.uniform(100, 300)), int(rng.integers(50, 150))] for _ in range(80)]
    pairs_b = [[ll - float(rng.uniform(0, 20)), words] for ll, words in pairs_a]
    values_a, values_b = rng.normal(-2, 1, 80).tolist(), rng.normal(-2.2, 1, 80).tolist()
    for name, a, b in [
        ("weighted_perplexity", pairs_a, pairs_b),
        ("bits_per_byte", pairs_a, pairs_b),
        ("perplexity", values_a, values_b),
        ("mean", values_a, values_b),
    ]:
        aggregate = AGGREGATION_REGISTRY[name]
        for other in (None, b):
            vectorised = report._bootstrap(name, aggregate, a, other)
            by_hand = report._bootstrap("lm-eval's function", aggregate, a, other)
            assert vectorised > 0 and vectorised == pytest.approx(by_hand, rel=1e-9), name


def _two_model_rows() -> tuple[list, list]:
    from ladder.eval.models import ModelRef, ModelResults

    rng = np.random.default_rng(4)
    models = []
    for label, accuracy in (("original", 0.6), ("ladder", 0.5)):
        items = (rng.random(40) < accuracy).astype(float)
        record = _record("ladder_piqa", "acc,none", range(40), items, "mean", items.mean(), 0.05)
        record |= {"n-samples": {"ladder_piqa": {"effective": 40}}, "higher_is_better": {"ladder_piqa": {"acc": True}}}
        models.append(ModelResults(ModelRef(label, Path(label), label), "", {"ladder_piqa": record}))
    return models, report.build_rows(models)


def test_report_chart_gives_n_and_the_absolute_scores_beside_each_difference():
    models, rows = _two_model_rows()
    (row,) = rows
    axes = report.figure(models, rows).axes[0]
    assert [label.get_text() for label in axes.get_yticklabels()] == ["ladder_piqa\nn=40"]
    (text,) = [t.get_text() for t in axes.texts]
    original, ladder = row.scores[0].value, row.scores[1].value
    assert text.startswith(f"{ladder - original:+.4f} ± ") and text.endswith(f"({original:.4f} → {ladder:.4f})")


def test_markdown_table_is_aligned():
    models, rows = _two_model_rows()
    lines = report.markdown_table(["original", "ladder"], rows).splitlines()
    assert len(lines) == 3 and len({len(line) for line in lines}) == 1  # padded columns
    assert [cell.strip() for cell in lines[0].split("|")[1:-1]] == [
        "task",
        "metric",
        "n",
        "original",
        "ladder",
        "Δ ladder",
    ]
    assert lines[1].startswith("|:---") and lines[1].endswith(":|")  # text left, numbers right
    assert lines[2].startswith("| ladder_piqa | acc ↑    |  40 | 0.5250 ± 0.0500 |")
