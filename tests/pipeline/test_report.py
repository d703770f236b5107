"""The run report and the model card, rendered from a small ledger + metrics fixture.

Checks that every section is there, that the privacy statement's numbers are the
ledger's, that tables carry human labels (no code keys, no raw JSON), and that the
page renders in headless Chromium (skipped, saying why, where no browser is installed).
"""

from __future__ import annotations

import json
import math
import re

import pytest

from pipeline import model_card, privacy_text, report
from tests import support
from tff_algorithms.privacy import accounting, accounting_spec

FARS = ("0.1", "0.01", "0.001")


def _ledger(rounds: int = 4, noise: float = 1.5, convention: str = "strict") -> dict:
    spec = accounting_spec.AccountingSpec(
        population=400,
        users_per_round=64,
        rounds=rounds,
        noise_multiplier=noise,
        delta=1e-5,
        users_per_virtual_client=8,
        convention=convention,
    )
    history = []
    for round_num in range(1, rounds + 1):
        epsilon = accounting.compute_privacy(
            accounting_spec.AccountingSpec(**{**spec.to_dict(), "rounds": round_num})
        ).epsilon
        history.append(
            {
                "round": round_num,
                "epsilon": epsilon if math.isfinite(epsilon) else None,
                "zcdp_rho": None,
            }
        )
    return {"format": "dp-fedemb-privacy-ledger/2", "spec": spec.to_dict(), "history": history}


def _result(base: float) -> dict:
    return {
        "id": 1,
        "identities": 50,
        "images": 200,
        "genuine_pairs": 300,
        "impostor_pairs": 19_600,
        "recall_at_far": {far: base * (3 - i) / 3 for i, far in enumerate(FARS)},
        "recall_at_far_interval": {
            far: [base * (3 - i) / 3 - 0.02, base * (3 - i) / 3 + 0.02]
            for i, far in enumerate(FARS)
        },
        "roc": {"far": [1e-3, 1e-2, 1e-1, 1.0], "recall": [base / 3, base / 2, base, 1.0]},
    }


def _inputs(ledger: dict, with_round_zero: bool = True) -> dict:
    model = _result(0.6)
    model["versus"] = {
        "pretrained": {far: {"difference": 0.05, "interval": [0.01, 0.09]} for far in FARS}
    }
    model["id"] = 2
    evaluation = {
        "model": model,
        "pretrained": _result(0.5),
        "epsilon": privacy_text.final_epsilon(ledger),
        "delta": ledger["spec"]["delta"],
        "privacy_budget_epsilon": 10.0,
        "bootstrap": {"resamples": 200, "confidence": 0.95},
        "blessed": True,
        "not_blessed_because": [],
    }
    evaluated = [0, 2, 4] if with_round_zero else [2, 4]
    history = [
        {"round": r, "eval": {"recall_at_far": {far: 0.4 + 0.02 * r for far in FARS}}}
        | ({"epsilon": ledger["history"][r - 1]["epsilon"]} if r else {})
        for r in evaluated
    ]
    training_metrics = {"algorithm": "dp-fedemb", "history": history, "config": {}}
    schedule = {
        "max_participations": 4,
        "min_separation": 0,
        "mode": "sampled",
        "rounds": 4,
        "rounds_per_epoch": 6,
        "sampling_units": 400,
        "units_per_round": 64,
        "unscheduled_users": 0,
        "users": 400,
        "users_per_round": 64,
        "users_per_virtual_client": 8,
        "virtual_clients_per_round": 8,
    }
    dedup = {
        "train_vs_evaluation": {
            "candidate_records": 1600,
            "candidate_split": "train",
            "reference_splits": "validation/test",
            "removed_exact": 3,
            "removed_near": 5,
            "max_removed_fraction": 0.1,
        }
    }
    return {
        "evaluation": evaluation,
        "ledger": ledger,
        "training_metrics": training_metrics,
        "schedule": schedule,
        "dedup": dedup,
    }


@pytest.fixture(scope="module")
def page() -> str:
    inputs = _inputs(_ledger())
    return report.render_report(**inputs, pushed_to="/srv/models/17", model_card="card.html")


def _statement(page: str) -> str:
    [statement] = re.findall(r'<p class="statement">(.*?)</p>', page)
    return statement


def test_every_section_is_present_in_order(page):
    positions = [page.index(f'<h2 id="{section}">') for section in report.SECTION_IDS]
    assert positions == sorted(positions)
    # The statement opens the page: nothing but the title before it.
    assert page.index('<p class="statement">') < page.index('<h2 id="outcome">')
    assert page.count("<img") >= 4 and page.count("<figcaption>") >= 4
    assert "gain over the pretrained start at FAR=0.01" in page and "bootstrap intervals" in page
    assert 'href="card.html"' in page


def test_statement_numbers_are_the_ledgers(page):
    ledger = _ledger()
    statement = _statement(page)
    epsilon = ledger["history"][-1]["epsilon"]
    assert f"ε = {epsilon:.2f}" in statement
    assert f"e^{epsilon:.2f}" in statement
    factor = float(re.search(r"≈ ([\d,.e+]+),", statement).group(1).replace(",", ""))
    assert factor == pytest.approx(math.exp(epsilon), rel=0.01)
    assert statement.count(f"δ = {ledger['spec']['delta']:g}") == 2
    assert f"{ledger['spec']['population']:,} training users" in statement
    for phrase in (
        "Unit: user",
        "replacing all of any one user&#x27;s images",
        privacy_text.RELATION_LABELS["replace_one"],
        "Accountant: PLD",
        "Convention: strict (L2 sensitivity 2 × clip norm)",
    ):
        assert phrase in statement, phrase


def test_tables_use_human_labels_and_units(page):
    # No code key as a label, and the accounting is a table, not a JSON dict.
    for key in ("sampling_units", "min_separation", "neighboring_relation", "users_per_round"):
        assert f"<th>{key}" not in page, key
    assert '"population"' not in page and "{&quot;" not in page
    for row in (
        "<th>sampling units (users or user groups drawn)</th><td>400 units</td>",
        "<th>fewest rounds between two participations of one user</th><td>0 rounds</td>",
        "<th>users per round (M)</th><td>64 users (8 virtual clients of 8 users)</td>",
        "<th>noise multiplier given to the accountant</th><td>0.75",
        "<td>1,600 images</td>",
        "<td>0.50% (stop above 10%)</td>",
    ):
        assert row in page, row


def test_recall_during_training_starts_at_round_zero(page):
    assert "<th>0 (start)</th>" in page
    assert "Round 0 is the start" in page
    without = report.render_report(
        **_inputs(_ledger(), with_round_zero=False), pushed_to=None, model_card=None
    )
    assert "records no evaluation at round 0" in without and "begins at round 2" in without
    assert "<th>0 (start)</th>" not in without and "Not pushed" in without


def test_extrapolation_caption_says_what_is_held_fixed(page):
    caption = report.extrapolation_caption(_ledger())
    assert html_escaped(caption) in page
    for fixed in ("Held fixed: 4 rounds", "δ = 1e-05", "8 users per virtual client", "× M / 64"):
        assert fixed in caption, fixed


def html_escaped(text: str) -> str:
    import html

    return html.escape(text)


def test_statement_without_noise_and_under_the_paper_convention():
    noiseless = privacy_text.privacy_statement(_ledger(rounds=1, noise=0.0))
    assert "no differential privacy guarantee" in noiseless
    paper = privacy_text.privacy_statement(_ledger(rounds=2, convention="paper"))
    assert "paper (comparison only" in paper and "sensitivity 1 × clip norm" in paper


def test_model_card_fields_and_renderings(tmp_path):
    ledger = _ledger()
    inputs = _inputs(ledger)
    card = model_card.build_model_card(
        inputs["evaluation"],
        ledger,
        inputs["training_metrics"],
        inputs["schedule"],
        pushed_to="/srv/models/17",
        version="17",
        serving_bounds=(25_000_000, 100_000_000),
    )
    # The Model Card Toolkit schema's top-level sections and field names.
    assert set(card) == {
        "schema_version",
        "model_details",
        "model_parameters",
        "quantitative_analysis",
        "considerations",
    }
    assert card["model_details"]["version"]["name"] == "17"
    considerations = card["considerations"]
    assert considerations["use_cases"] and considerations["limitations"]
    privacy = considerations["ethical_considerations"][0]["mitigation_strategy"]
    assert privacy == privacy_text.privacy_statement(ledger)
    metrics = card["quantitative_analysis"]["performance_metrics"]
    recall = {m["type"]: m for m in metrics}["recall at FAR 0.01"]
    assert recall["value"] == "0.4000"
    assert recall["confidence_interval"] == {"lower_bound": "0.3800", "upper_bound": "0.4200"}
    assert any(m["type"].startswith("recall gain over the pretrained start") for m in metrics)
    paths = model_card.write_model_card(card, str(tmp_path))
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == sorted(
        [model_card.JSON_FILE, model_card.MARKDOWN_FILE, model_card.HTML_FILE]
    )
    assert json.loads((tmp_path / model_card.JSON_FILE).read_text()) == card
    markdown = (tmp_path / model_card.MARKDOWN_FILE).read_text()
    page = (tmp_path / model_card.HTML_FILE).read_text()
    for title in ("Privacy guarantee", "Intended use", "Data", "Utility", "Limits"):
        assert f"## {title}" in markdown and f">{title}</h2>" in page, title
    assert "| recall at FAR 0.01 | 0.4000 | [0.3800, 0.4200] |" in markdown
    # The serving signature's pixel bounds, which a caller must respect (issue 63).
    bounds = "at most 25,000,000 pixels an image and 100,000,000 a call"
    assert bounds in card["model_parameters"]["input_format"] and bounds in markdown


def test_report_and_card_render_in_headless_chromium(page, tmp_path):
    browser = support.chromium()
    if browser is None:
        pytest.skip(
            "no Chromium here (CI's .ci/run installs Debian's chromium; PyPI's playwright "
            "cannot fetch its browser offline)"
        )
    report_file = tmp_path / "index.html"
    report_file.write_text(page)
    ledger = _ledger()
    inputs = _inputs(ledger)
    card = model_card.build_model_card(
        inputs["evaluation"], ledger, inputs["training_metrics"], inputs["schedule"], None
    )
    model_card.write_model_card(card, str(tmp_path))
    # The DOM the browser built: every section is there after parsing, not just in the text.
    dom = support.headless_chromium(
        browser, str(tmp_path / "profile"), "--dump-dom", f"file://{report_file}"
    ).stdout
    for section in report.SECTION_IDS:
        assert f'id="{section}"' in dom, f"report section {section!r} missing in Chromium's DOM"
    card_dom = support.headless_chromium(
        browser,
        str(tmp_path / "profile"),
        "--dump-dom",
        f"file://{tmp_path / model_card.HTML_FILE}",
    ).stdout
    for section in ("privacy", "intended-use", "data", "utility", "limits"):
        assert f'id="{section}"' in card_dom, f"model card section {section!r} missing"
    # A blank page is one shade; a rendered report has text and plots in many.
    shades = support.screenshot_shades(browser, str(tmp_path / "profile"), report_file, "1000,3000")
    assert shades is None or shades > 50


def test_a_model_from_two_private_runs_shows_their_composed_epsilon():
    from tff_algorithms.privacy import composition, ledger

    pretrain = ledger.PrivacyLedger(
        accounting_spec.AccountingSpec(
            population=400,
            users_per_round=32,
            rounds=3,
            noise_multiplier=1.0,
            delta=1e-5,
            mechanism=accounting_spec.Mechanism.LOGIT_DP,
        )
    )
    train = ledger.PrivacyLedger.from_dict(_ledger())
    for run in (pretrain,):
        for step in range(1, 4):
            run.record_round(step)
    composed = composition.model_composition(
        [("PrivatePretrain", pretrain), ("PrivateTrain", train)], 1e-5
    )
    epsilon = composed["epsilon"]
    assert epsilon > max(pretrain.epsilon, train.epsilon)
    ledger_dict = _ledger()
    statement = privacy_text.privacy_statement(ledger_dict, composed)
    assert f"ε = {epsilon:.2f}" in statement
    assert "Logit-DP contrastive pretraining (3 steps" in statement
    assert f"private training (4 rounds, ε = {train.epsilon:.2f})" in statement
    rows = dict(privacy_text.accounting_rows(ledger_dict, composed))
    assert rows["ε of the model (all its private runs, composed)"] == f"{epsilon:.2f}"
    inputs = _inputs(ledger_dict)
    card = model_card.build_model_card(
        inputs["evaluation"],
        ledger_dict,
        inputs["training_metrics"],
        inputs["schedule"],
        pushed_to=None,
        composition=composed,
    )
    assert f"ε = {epsilon:.2f}" in card["model_details"]["overview"]
    page = report.render_report(**inputs, pushed_to=None, composition=composed)
    assert "all its private runs, composed" in page and f"ε = {epsilon:.2f}" in page
    # One run: the composition is the ledger's own epsilon, and the text is unchanged.
    alone = composition.model_composition([("PrivateTrain", train)], 1e-5)
    assert alone["epsilon"] == train.epsilon
    assert privacy_text.privacy_statement(ledger_dict, alone) == privacy_text.privacy_statement(
        ledger_dict
    )


def test_the_model_card_shows_the_shared_negatives_releases_with_their_epsilon(tmp_path):
    from tff_algorithms.privacy import dplc_releases, ledger

    plan = dplc_releases.ReleasePlan(
        every_rounds=2,
        num_clusters=3,
        noise_multiplier=6.0,
        cluster_size=16,
        margin=1.0,
        pool_users=64,
        sensitivity=2 * math.sin(1.0) / 16,
    )
    spec = accounting_spec.AccountingSpec.from_dict(_ledger()["spec"])
    with_releases = ledger.PrivacyLedger(spec, plan)
    for round_num in range(1, spec.rounds + 1):
        with_releases.record_round(round_num)
    ledger_dict = with_releases.to_dict()
    alone = dplc_releases.releases_epsilon(plan, spec.rounds, spec.delta)
    assert 0 < alone < with_releases.epsilon
    inputs = _inputs(ledger_dict)
    card = model_card.build_model_card(
        inputs["evaluation"], ledger_dict, inputs["training_metrics"], inputs["schedule"], None
    )
    privacy = card["considerations"]["ethical_considerations"][0]["mitigation_strategy"]
    # The report's statement, then its releases row: 4 rounds, a release every 2 -> 2.
    assert privacy.startswith(privacy_text.privacy_statement(ledger_dict))
    assert "Shared negatives (DPLC releases, in ε above): 2 release(s) of 3 noisy" in privacy
    assert f"ε of the releases alone {alone:.2f}." in privacy
    assert f"ε = {with_releases.epsilon:.2f}" in card["model_details"]["overview"]
    model_card.write_model_card(card, str(tmp_path))
    for name in (model_card.MARKDOWN_FILE, model_card.HTML_FILE):
        assert f"ε of the releases alone {alone:.2f}" in (tmp_path / name).read_text(), name
    # The report shows the same row.
    page = report.render_report(**inputs, pushed_to=None)
    assert f"ε of the releases alone {alone:.2f}" in page
    # Without releases the card's paragraph is the statement alone.
    plain = _ledger()
    assert model_card.privacy_guarantee(plain) == privacy_text.privacy_statement(plain)


def test_report_and_card_say_what_the_split_mode_means(tmp_path):
    ledger = _ledger()
    faces = privacy_text.privacy_statement(ledger, split_mode="identity_and_user")
    assert faces == privacy_text.privacy_statement(ledger)
    assert faces.count("held-out evaluation users") == 1
    inputs = _inputs(ledger)
    inputs["evaluation"]["split_mode"] = "identity"
    page = report.render_report(**inputs, pushed_to=None)
    statement = _statement(page)
    # Evaluation users may be training users in mode identity: the text must not claim
    # they are outside the guarantee, and must say whose records are.
    assert "held-out evaluation users" not in statement
    assert "records of evaluation identities are never trained on" in statement
    [protocol] = re.findall(r'<p class="protocol">(.*?)</p>', page)
    assert "split mode identity" in protocol and "Recall@FAR measures" in protocol
    inputs["evaluation"]["split_mode"] = "held_out_images"
    card = model_card.build_model_card(
        inputs["evaluation"], ledger, inputs["training_metrics"], inputs["schedule"], None
    )
    considerations = card["considerations"]
    privacy = considerations["ethical_considerations"][0]["mitigation_strategy"]
    assert "identities they show are training identities" in privacy
    assert any(
        "genuine pairs: two images of one identity" in item["description"]
        for item in considerations["limitations"]
    )


def test_report_and_card_say_whose_the_evaluation_inputs_records_are():
    ledger = _ledger()
    inputs = _inputs(ledger)
    inputs["evaluation"].update(split_mode="held_out_images", evaluation_inputs=True)
    page = report.render_report(**inputs, pushed_to=None)
    statement = _statement(page)
    assert "data.evaluation_inputs" in statement and "none covered by the guarantee" in statement
    [protocol] = re.findall(r'<p class="protocol">(.*?)</p>', page)
    assert "data.evaluation_inputs" in protocol
    assert "held-out users&#x27; images" not in protocol  # not the held-out users' text
    card = model_card.build_model_card(
        inputs["evaluation"], ledger, inputs["training_metrics"], inputs["schedule"], None
    )
    privacy = card["considerations"]["ethical_considerations"][0]["mitigation_strategy"]
    assert "data.evaluation_inputs" in privacy
    # Without evaluation inputs neither text mentions them.
    inputs["evaluation"]["evaluation_inputs"] = False
    assert "evaluation_inputs" not in report.render_report(**inputs, pushed_to=None)
