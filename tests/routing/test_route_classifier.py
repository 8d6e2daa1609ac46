"""The routing classifier: fit, JSON save/load, calibrated-enough probabilities."""

from __future__ import annotations

import json

import pytest
from routing_prompts import labelled_prompts

from opd.routing.classifier import Classifier, fit


def test_fit_generalizes_to_held_out_prompts_and_round_trips(tmp_path):
    train = labelled_prompts(80, seed=1)
    held = labelled_prompts(40, seed=2)
    clf = fit([x for x, _ in train], [y for _, y in train])
    acc = clf.accuracy([x for x, _ in held], [y for _, y in held])
    assert acc > 0.9
    probs = clf.predict_proba("Compute 12*7.")
    assert set(probs) == {"code", "general", "math"} and sum(probs.values()) == pytest.approx(1.0)
    assert max(probs, key=probs.get) == "math"

    path = clf.save(tmp_path / "clf.json")
    text = path.read_text()
    assert json.loads(text)["format"] == "opd-text-classifier"  # plain JSON, no pickle
    back = Classifier.load(path)
    for x, _ in held[:20]:
        a, b = clf.predict_proba(x), back.predict_proba(x)
        assert a == pytest.approx(b, abs=1e-4)


def test_unknown_text_is_uncertain_and_known_text_is_confident():
    train = labelled_prompts(80, seed=1)
    clf = fit([x for x, _ in train], [y for _, y in train])
    assert max(clf.predict_proba("Write a short poem about cats.").values()) > 0.8
    # nothing the classifier knows: probabilities are the (balanced) priors, about 1/3 each
    assert max(clf.predict_proba("\u2603\u2603").values()) < 0.5


def test_fit_refuses_bad_input_and_load_refuses_other_files(tmp_path):
    with pytest.raises(ValueError, match="two labels"):
        fit(["a", "b"], ["x", "x"])
    with pytest.raises(ValueError, match="equal"):
        fit(["a"], ["x", "y"])
    other = tmp_path / "x.json"
    other.write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="opd route fit"):
        Classifier.load(other)
