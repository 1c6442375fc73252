"""The promotion gate (tasks/decisions/promotion.py) as a table, its reading of COMPLETED.json's `eval` block,
the event it becomes, and its effect on a registered model version through a hand-written MLflow client."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from spotrun.tasks.decisions.promotion import (
    KEPT,
    PROMOTED,
    PROMOTION_LABEL,
    PromotionDecision,
    decide_from_eval,
    decide_promotion,
    event_payload,
    promotion_for,
)
from spotrun.tasks.tracking.mlflow_run import MlflowRun, RunRef
from spotrun.tasks.tracking.versions import EVAL_TAG, description, finish_version, lineage_tags
from spotrun.trainer.checkpoint.completion import completed_eval
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.spec.runs import Promotion, RunSource
from spotrun.trainer.storage import LocalStorage, put_bytes

CHAMP = RunSource(job="nightly", run_key="2026-12-04", storage="/s/nightly/2026-12-04", step=200, version="3")


def _rule(
    mode: str = "min", better_by: float = 0.0, metric: str = "eval_loss", held: bool = True
) -> Promotion:
    return Promotion(metric=metric, mode=mode, better_by=better_by, champion=CHAMP if held else None)


# (case, rule, challenger's metrics, champion's metrics, promoted, words the reason holds)
CASES: list[tuple[str, Promotion, dict[str, Any] | None, dict[str, Any] | None, bool, list[str]]] = [
    ("no champion: the first version", _rule(held=False), {"eval_loss": 1.2}, None, True,
     ["promoted: first version", "'champion'", "1.2"]),
    ("min, better", _rule(), {"eval_loss": 1.2}, {"eval_loss": 1.3}, True,
     ["promoted:", "eval_loss 1.2 < 1.3", "champion v3 of 2026-12-04", "min"]),
    ("min, equal: a tie keeps", _rule(), {"eval_loss": 1.3}, {"eval_loss": 1.3}, False,
     ["kept:", "1.3 = 1.3"]),
    ("min, worse", _rule(), {"eval_loss": 1.4}, {"eval_loss": 1.3}, False, ["kept:", "1.4 > 1.3"]),
    ("max, better", _rule("max", metric="acc"), {"acc": 0.91}, {"acc": 0.9}, True,
     ["promoted:", "0.91 > 0.9"]),
    ("max, worse", _rule("max", metric="acc"), {"acc": 0.89}, {"acc": 0.9}, False, ["kept:", "0.89 < 0.9"]),
    ("max, equal", _rule("max", metric="acc"), {"acc": 0.9}, {"acc": 0.9}, False, ["kept:"]),
    ("better_by: within the margin", _rule(better_by=0.1), {"eval_loss": 1.25}, {"eval_loss": 1.3}, False,
     ["kept:", "better by >= 0.1"]),
    ("better_by: exactly the margin (floats)", _rule(better_by=0.1), {"eval_loss": 1.15},
     {"eval_loss": 1.25}, True, ["promoted:"]),
    ("better_by: past the margin", _rule("max", 0.05, "acc"), {"acc": 0.96}, {"acc": 0.9}, True,
     ["promoted:"]),
    ("metric missing on the new model", _rule(), {"loss": 1.0, "acc": 0.5}, {"eval_loss": 1.3}, False,
     ["kept:", "no eval_loss", "returned acc, loss", "set promote.metric"]),
    ("no evaluation at all", _rule(), None, {"eval_loss": 1.3}, False, ["kept:", "no evaluation"]),
    ("NaN on the new model", _rule(), {"eval_loss": math.nan}, {"eval_loss": 1.3}, False, ["kept:", "nan"]),
    ("inf on the new model (max)", _rule("max", metric="acc"), {"acc": math.inf}, {"acc": 0.9}, False,
     ["kept:", "inf"]),
    ("not a number", _rule(), {"eval_loss": "low"}, {"eval_loss": 1.3}, False, ["kept:", "not a number"]),
    ("an int is a number", _rule(), {"eval_loss": 1}, {"eval_loss": 2}, True, ["promoted:"]),
    ("champion held but not evaluated", _rule(), {"eval_loss": 1.4}, None, True,
     ["promoted without a comparison", "champion v3 of 2026-12-04 could not be evaluated"]),
    ("champion NaN", _rule(), {"eval_loss": 1.4}, {"eval_loss": math.nan}, True, ["without a comparison"]),
    ("champion lacks the metric", _rule(), {"eval_loss": 1.4}, {"loss": 1.0}, True, ["without a comparison"]),
    ("no champion, no metric: still kept", _rule(held=False), {}, None, False, ["kept:", "returned nothing"]),
]  # fmt: skip  # one case per line: a table


@pytest.mark.parametrize(
    ("rule", "new", "old", "promoted", "words"), [pytest.param(*c[1:], id=c[0]) for c in CASES]
)
def test_decide_promotion(
    rule: Promotion, new: dict[str, Any] | None, old: dict[str, Any] | None, promoted: bool, words: list[str]
) -> None:
    d = decide_promotion(rule, new, old)
    assert d.promoted is promoted
    assert "\n" not in d.reason and all(w in d.reason for w in words), d.reason
    assert (d.metric, d.mode, d.alias) == (rule.metric, rule.mode, rule.alias)
    if d.challenger is not None:
        assert d.challenger == float(new[rule.metric])  # type: ignore[index]
    if rule.champion is not None:
        assert (d.champion_version, d.champion_run) == ("3", "2026-12-04")


def test_the_notes_say_why_figures_are_missing() -> None:
    d = decide_promotion(_rule(), {"eval_loss": 1.0}, None, champion_note="checkpoint step 200 was pruned")
    assert d.promoted and "checkpoint step 200 was pruned" in d.reason
    d = decide_promotion(_rule(), None, None, challenger_note="evaluation skipped: no evaluate()")
    assert not d.promoted and "no evaluate()" in d.reason


BLOCKS: list[tuple[str, dict[str, Any] | None, bool, str]] = [
    # (case, COMPLETED.json's eval block, promoted, in the reason)
    ("none written", None, False, "has no evaluation"),
    (
        "skipped",
        {"metrics": {}, "champion": None, "skipped": "the recipe has no evaluate()"},
        False,
        "evaluation skipped: the recipe has no evaluate()",
    ),
    (
        "both evaluated",
        {
            "metrics": {"eval_loss": 1.1},
            "champion": {
                "metrics": {"eval_loss": 1.2},
                "job": "nightly",
                "run_key": "2026-12-04",
                "step": 200,
                "version": "3",
                "reason": "",
            },
            "skipped": "",
        },
        True,
        "1.1 < 1.2",
    ),
    (
        "champion unloadable",
        {
            "metrics": {"eval_loss": 1.1},
            "champion": {"metrics": None, "version": "3", "reason": "its checkpoint failed validation"},
            "skipped": "",
        },
        True,
        "its checkpoint failed validation",
    ),
]


@pytest.mark.parametrize(("block", "promoted", "words"), [pytest.param(*c[1:], id=c[0]) for c in BLOCKS])
def test_decide_from_the_eval_block(block: dict[str, Any] | None, promoted: bool, words: str) -> None:
    d = decide_from_eval(_rule(), block)
    assert d.promoted is promoted and words in d.reason, d.reason


def test_a_champion_only_the_trainer_names_still_counts_as_held() -> None:
    block = {
        "metrics": {"eval_loss": 1.5},
        "champion": {"metrics": {"eval_loss": 1.2}, "version": "7", "run_key": "2026-12-01"},
        "skipped": "",
    }
    d = decide_from_eval(_rule(held=False), block)
    assert not d.promoted and (d.champion_version, d.champion_run) == ("7", "2026-12-01")


def _job(tmp_path: Path, **extra: Any) -> JobSpec:
    return JobSpec.model_validate(
        {"name": "nightly", "recipe": "digits", "total_steps": 200, "storage": str(tmp_path / "s")} | extra
    )


def _completed(storage: LocalStorage, block: dict[str, Any] | None) -> None:
    body: dict[str, Any] = {"job": "nightly", "step": 200}
    if block is not None:
        body["eval"] = block
    put_bytes(storage, "COMPLETED.json", json.dumps(body).encode())


def test_promotion_for_reads_completed_json(tmp_path: Path) -> None:
    assert promotion_for(_job(tmp_path)) is None  # no gate
    job = _job(tmp_path, promote={"metric": "eval_loss"})
    store = LocalStorage(tmp_path / "s")
    assert completed_eval(store) is None
    d = promotion_for(job)
    assert d is not None and not d.promoted and "has no evaluation" in d.reason  # not completed yet
    _completed(store, {"metrics": {"eval_loss": 0.5}, "champion": None, "skipped": ""})
    d = promotion_for(job)
    assert d is not None and d.promoted and d.version is None and not d.alias_moved
    missing = _job(tmp_path, promote={}, storage=str(tmp_path / "gone"))
    d = promotion_for(missing)
    assert d is not None and not d.promoted and "not read" in d.reason


def test_the_event_carries_the_decision_and_a_label_to_match() -> None:
    d = decide_promotion(_rule(), {"eval_loss": 1.2}, {"eval_loss": 1.3})
    payload, labels = event_payload(d, run_key="2026-12-05", job_run_id="jr1", flow_run_id="fr1")
    assert labels == {PROMOTION_LABEL: PROMOTED}
    assert payload["promoted"] is True and (payload["challenger"], payload["champion"]) == (1.2, 1.3)
    assert (payload["run_key"], payload["job_run_id"], payload["flow_run_id"]) == ("2026-12-05", "jr1", "fr1")
    json.dumps(payload)  # an event payload is JSON
    kept = decide_promotion(_rule(), {"eval_loss": 1.4}, {"eval_loss": 1.3})
    assert event_payload(kept, run_key=None, job_run_id="")[1] == {PROMOTION_LABEL: KEPT}


# -- the effect on MLflow, through a hand-written client ------------------------------------------


class FakeClient:
    """The MlflowClient calls versions.py makes, recorded."""

    def __init__(self) -> None:
        self.metrics: list[Any] = []
        self.run_tags: dict[str, str] = {}
        self.version_tags: dict[tuple[str, str], dict[str, str]] = {}
        self.descriptions: dict[tuple[str, str], str] = {}
        self.aliases: dict[tuple[str, str], str] = {}

    def log_batch(self, run_id: str, metrics: Any = (), params: Any = (), tags: Any = ()) -> None:
        self.metrics += list(metrics)
        self.run_tags |= {t.key: t.value for t in tags}

    def set_model_version_tag(self, name: str, version: str, key: str, value: str) -> None:
        self.version_tags.setdefault((name, version), {})[key] = value

    def update_model_version(self, name: str, version: str, description: str) -> None:
        self.descriptions[(name, version)] = description

    def set_registered_model_alias(self, name: str, alias: str, version: str) -> None:
        self.aliases[(name, alias)] = version


SOURCE = RunSource(job="nightly", run_key="2026-12-04", storage="/s/2026-12-04", step=200, version="3")


def _keyed(tmp_path: Path, **extra: Any) -> JobSpec:
    return _job(
        tmp_path,
        run_key="2026-12-05",
        run_values={"scheduled_date": "2026-12-05", "run_key": "2026-12-05"},
        init_from={"job": "nightly", "parts": ["model", "optimizer"], "source": SOURCE.model_dump()},
        **extra,
    )


@pytest.mark.parametrize(("new", "moved"), [(1.1, True), (1.3, False)], ids=["wins", "loses"])
def test_finish_version_logs_tags_describes_and_moves_the_alias_only_when_it_wins(
    tmp_path: Path, new: float, moved: bool
) -> None:
    job = _keyed(tmp_path, promote={"champion": SOURCE.model_dump()})
    store = LocalStorage(tmp_path / "s")
    block = {
        "metrics": {"eval_loss": new, "acc": 0.5},
        "champion": {"metrics": {"eval_loss": 1.2}, "version": "3", "run_key": "2026-12-04", "reason": ""},
        "skipped": "",
    }
    _completed(store, block)
    client = FakeClient()
    run = MlflowRun(client, RunRef("sqlite:///x.db", "1", "r1"), {})
    d = finish_version(run, job, "jr-5", model="nightly/4", storage=store, step=200)
    assert d is not None and d.promoted is moved and d.alias_moved is moved
    assert (d.model, d.version) == ("nightly", "4")
    assert client.aliases == ({("nightly", "champion"): "4"} if moved else {})
    sent = {m.key: (m.value, m.step) for m in client.metrics}
    assert sent == {"eval_loss": (new, 200), "acc": (0.5, 200), "champion/eval_loss": (1.2, 200)}
    tags = client.version_tags[("nightly", "4")]
    assert tags["spotrun.run_key"] == "2026-12-05" and tags["spotrun.job_run_id"] == "jr-5"
    assert tags["spotrun.init_from"] == "nightly/2026-12-04@200" and tags["spotrun.init_from.version"] == "3"
    assert tags["spotrun.promotion"] == (PROMOTED if moved else KEPT)
    text = client.descriptions[("nightly", "4")]
    assert "run key 2026-12-05 of nightly" in text and "model and optimizer from nightly 2026-12-04" in text
    assert d.reason in text
    again = FakeClient()  # a second controller: the metrics are not logged twice
    run.client = again
    finish_version(run, job, "jr-5", model="nightly/4", storage=store, step=200)
    assert again.metrics == [] and run.tags[EVAL_TAG] == "3"


def test_without_a_version_the_decision_is_still_made(tmp_path: Path) -> None:
    job = _keyed(tmp_path, promote={})
    store = LocalStorage(tmp_path / "s")
    _completed(store, {"metrics": {"eval_loss": 1.0}, "champion": None, "skipped": ""})
    client = FakeClient()
    d = finish_version(
        MlflowRun(client, RunRef("u", "1", "r"), {}), job, "jr", model=None, storage=store, step=200
    )
    assert d is not None and d.promoted and not d.alias_moved and client.aliases == {}


def test_lineage_of_a_fresh_start_and_of_an_unkeyed_job(tmp_path: Path) -> None:
    fresh = _job(tmp_path, run_key="k1", run_values={"run_key": "k1"}, init_from={"job": "nightly"})
    assert lineage_tags(fresh) == {
        "spotrun.run_key": "k1",
        "spotrun.init_from": "none: fresh start",
        "spotrun.init_from.parts": "model",
    }
    assert "a fresh start" in description(fresh, "jr", None)
    assert lineage_tags(_job(tmp_path)) == {}
    assert description(_job(tmp_path), "jr", None) == "job nightly (job run jr)"


def test_a_decision_comes_back_from_its_dict() -> None:
    d = decide_promotion(Promotion(), {"eval_loss": 1.0}, None).registered("m", "2", True)
    assert PromotionDecision.from_dict(d.as_dict() | {"run_key": "k"}) == d
